#!/usr/bin/env bash
# Build llama.cpp's llama-server and ggml-rpc-server from the llama.cpp that
# llama-cpp-python vendors in its sdist, so the peers bench compares meshpipe
# against the same llama.cpp revision the stages run.
#
#   deploy/build-llama-cpp.sh VERSION DIR     e.g. 0.3.36 /work/llama-cpp-bin
#
# DIR ends up holding llama-server, ggml-rpc-server and the shared libraries
# they load (the RPATH is $ORIGIN, so the directory can be moved as a whole).
# About 10 minutes on 2 cores.
set -euo pipefail

version=${1:?usage: build-llama-cpp.sh VERSION DIR}
dest=${2:?usage: build-llama-cpp.sh VERSION DIR}
python=${PYTHON:-python}
jobs=${JOBS:-2}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$python" -m pip download --no-deps --no-binary :all: \
    "llama-cpp-python==$version" -d "$work"
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"

cmake -S "$src" -B "$src/build" -DGGML_RPC=ON -DLLAMA_CURL=OFF \
    -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON -DCMAKE_BUILD_TYPE=Release
cmake --build "$src/build" -j"$jobs" --target llama-server ggml-rpc-server

mkdir -p "$dest"
# The binaries and every shared library they link sit in build/bin.
find "$src/build/bin" -maxdepth 1 \( -name 'llama-server' -o -name 'ggml-rpc-server' \
    -o -name '*.so*' \) -exec cp -a {} "$dest"/ \;
echo "built into $dest:"
ls "$dest"
