# Registers one CTest test per GoogleTest suite of a test binary (run after each link).
#   cmake -D BIN=<test binary> -D OUT=<ctest file> -D TIMEOUT=<seconds> -D LABELS=<labels> -P gtest_suites.cmake
# Why not gtest_discover_tests (one CTest test per TEST): every test then starts its own
# process, and a process of this project pays LibTorch's static initialisation (~0.6 s: the
# operator registry of libtorch_cpu and libtorch_cuda) before its first line; over ~560 tests
# that was ~6 minutes of CI doing nothing else. A suite runs its tests in one process, as
# GoogleTest is made to; `ctest -R Suite` still picks one, `--gtest_filter` inside it one test.
execute_process(COMMAND "${BIN}" --gtest_list_tests OUTPUT_VARIABLE listing RESULT_VARIABLE rc TIMEOUT 60)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${BIN} --gtest_list_tests failed (${rc}):\n${listing}")
endif()
string(REPLACE "\n" ";" lines "${listing}")
set(content "")
foreach(line IN LISTS lines)
  # Suite lines are "Suite." or "Prefix/Suite." (a value-parameterised instantiation), perhaps
  # followed by "  # TypeParam = ..."; test lines are indented.
  if(line MATCHES "^([A-Za-z0-9_/]+)\\.( .*)?$")
    set(suite "${CMAKE_MATCH_1}")
    string(APPEND content "add_test([=[${suite}]=] [==[${BIN}]==] [==[--gtest_filter=${suite}.*]==])\n"
                          "set_tests_properties([=[${suite}]=] PROPERTIES TIMEOUT ${TIMEOUT}")
    if(LABELS)
      string(APPEND content " LABELS [==[${LABELS}]==]")
    endif()
    string(APPEND content ")\n")
  endif()
endforeach()
file(WRITE "${OUT}" "${content}")
