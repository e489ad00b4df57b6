#!/bin/sh
# Runs a command as on a machine with no C/C++ compiler and no Python headers: in a private mount
# namespace, /dev/null is bound over every compiler on PATH (gcc, g++, cc, c++, clang, tcc and their
# versioned names) and an empty tmpfs over gcc's own directories and Python's include dirs. Nothing
# changes outside the namespace. Needs root (CI runs as root) and util-linux's unshare.
#
#   packaging/without_compilers.sh [--python PY]... CMD ARGS...
#
# Each --python names an interpreter whose include dir is hidden too (the system's python3 is always
# taken). Inside, `without_compilers.sh --verify` exits 0 only if nothing is left to find.
set -eu

if [ "${KVCHAT_IN_NO_COMPILER_NS:-}" != 1 ]; then
    [ "$(id -u)" = 0 ] || { echo "without_compilers.sh: needs root (unshare -m, mount)" >&2; exit 77; }
    command -v unshare >/dev/null || { echo "without_compilers.sh: unshare not found" >&2; exit 77; }
    KVCHAT_IN_NO_COMPILER_NS=1 exec unshare -m --propagation private "$0" "$@"
fi

pythons="python3"
while [ "${1:-}" = --python ]; do pythons="$pythons $2"; shift 2; done

hide_file() { [ -e "$1" ] && mount --bind /dev/null "$1"; }
hide_dir() { [ -d "$1" ] && mount -t tmpfs -o ro,size=4k kvchat-hidden "$1"; }

old_ifs=$IFS; IFS=:
for dir in $PATH; do
    IFS=$old_ifs
    [ -d "$dir" ] || continue
    for f in "$dir"/gcc "$dir"/gcc-[0-9]* "$dir"/g++ "$dir"/g++-[0-9]* "$dir"/cc "$dir"/c++ "$dir"/c89* \
             "$dir"/c99* "$dir"/*-linux-gnu-gcc* "$dir"/*-linux-gnu-g++* "$dir"/clang "$dir"/clang++ \
             "$dir"/clang-[0-9]* "$dir"/clang++-[0-9]* "$dir"/tcc "$dir"/icx "$dir"/icpx; do
        # /dev/null is not executable: shutil.which and execvp skip it, as if the file were absent
        [ -e "$f" ] && hide_file "$f" || true
    done
done
IFS=$old_ifs
# gcc's driver-side files (cc1, cc1plus, its omp.h and libgomp.so link) and LLVM's installs
for d in /usr/lib/gcc /usr/libexec/gcc /usr/lib/llvm-*; do hide_dir "$d" || true; done
for py in $pythons; do
    inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null) || continue
    hide_dir "$inc" || true
done
for d in /usr/include/python3* /usr/local/include/python3*; do hide_dir "$d" || true; done

if [ "${1:-}" = --verify ]; then
    for c in gcc g++ cc c++ clang clang++; do
        if command -v "$c" >/dev/null 2>&1 && [ -x "$(command -v "$c")" ]; then echo "still found: $c" >&2; exit 1; fi
    done
    for py in $pythons; do
        "$py" -c 'import sysconfig, os, sys; sys.exit(os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
            || { echo "still found: Python.h of $py" >&2; exit 1; }
    done
    exit 0
fi
unset KVCHAT_IN_NO_COMPILER_NS
exec "$@"
