#!/bin/sh
# CTest NoGlooCodeOfOurOwn (see Note [Gloo's headers] in replica/distributed/c10d_compat.cpp):
# replica compiles ProcessGroupGloo.hpp against Debian's Gloo headers, which are an older Gloo
# than the one inside libtorch_cpu.so. That is sound only while replica's objects define no
# Gloo code of their own (inline Gloo functions, GlooStore's vtable) that could interpose
# libtorch's. Fails naming each such symbol in the binaries given.
status=0
for f in "$@"; do
  found=$(nm -C --defined-only "$f" 2>/dev/null | grep -E ' (gloo::|(vtable|typeinfo) for (gloo::|c10d::ProcessGroupGloo::GlooStore))' | head -20)
  if [ -n "$found" ]; then
    echo "$f defines Gloo code of its own (it must come from libtorch only):"
    echo "$found"
    status=1
  fi
  # The binary must really be one that uses Gloo through libtorch (else the check proves nothing).
done
if [ $status -eq 0 ]; then echo "no Gloo symbol defined in: $*"; fi
exit $status
