# The wheel of `pip install .` (pyproject.toml, scikit-build-core sets SKBUILD): only the
# `replica` program goes in, as replica/_bin/replica beside the package's Python code
# (install component `python`; `cmake --install` of the library is unchanged).
#
# Built here (the default), its run path is the torch wheel installed beside the package
# ($ORIGIN/../../torch/lib, and the CUDA runtime of its nvidia-cu13 wheel), not the build
# environment's torch: pip builds in a temporary environment that is gone afterwards.
# REPLICA_PREBUILT_CLI=PATH packages a program built already instead (CMakeLists.txt stops
# before configuring anything else); python/replica/_binary.py puts the installed torch's
# libraries first on LD_LIBRARY_PATH whenever it starts the program, so either finds the
# LibTorch of the torch that Python imports.
if(REPLICA_PREBUILT_CLI)
  get_filename_component(REPLICA_PREBUILT_CLI "${REPLICA_PREBUILT_CLI}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
  if(NOT EXISTS "${REPLICA_PREBUILT_CLI}")
    message(FATAL_ERROR "REPLICA_PREBUILT_CLI=${REPLICA_PREBUILT_CLI} does not exist (build it first: ninja -C build replica_cli)")
  endif()
  message(STATUS "replica: packaging the prebuilt program ${REPLICA_PREBUILT_CLI}")
  install(PROGRAMS "${REPLICA_PREBUILT_CLI}" DESTINATION replica/_bin COMPONENT python)
  add_custom_target(replica_cli)  # pyproject.toml's build target: nothing to build
  # Read by the full configure only.
  set(REPLICA_UNUSED_HERE "${REPLICA_BUILD_TESTS}${REPLICA_BUILD_BENCH}")
else()
  set_target_properties(replica_cli PROPERTIES
    INSTALL_RPATH "$ORIGIN/../../torch/lib;$ORIGIN/../../nvidia/cu13/lib"
    INSTALL_RPATH_USE_LINK_PATH OFF)
  install(TARGETS replica_cli RUNTIME DESTINATION replica/_bin COMPONENT python EXCLUDE_FROM_ALL)
endif()
