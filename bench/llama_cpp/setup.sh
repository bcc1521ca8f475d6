#!/usr/bin/env bash
# What bench/bench_llama_cpp.py needs, in DIR (nothing of dofla's environment is changed):
#   DIR/runtime     llama.cpp's runtime and its CFFI bindings (the llama-cpp-py-sync wheel, CPU build), with
#                   cffi: pass it as --runtime
#   DIR/llama.cpp   the llama.cpp tree vendored by the llama-cpp-python source distribution, for its
#                   converter: pass DIR/llama.cpp/convert_hf_to_gguf.py as --converter
#   DIR/libisoc23.so  only where glibc is older than 2.38 (the wheel's libraries need it for four C23
#                   functions): the libraries' need is marked weak and this forwarder is built: pass it as
#                   --preload
# Versions: constraints.txt.   Usage: bench/llama_cpp/setup.sh DIR [PYTHON]
set -euo pipefail
dir=${1:?usage: bench/llama_cpp/setup.sh DIR [PYTHON]}
python=${2:-.venv/bin/python}
here=$(cd "$(dirname "$0")" && pwd)
constraints="$here/../../constraints.txt"
mkdir -p "$dir"
"$python" -m pip install -q --target "$dir/runtime" -c "$constraints" llama-cpp-py-sync cffi
"$python" -m pip download -q --no-deps --no-binary :all: -d "$dir/sdist" -c "$constraints" llama-cpp-python
archive=$(ls "$dir"/sdist/llama_cpp_python-*.tar.gz)
top=$(basename "$archive" .tar.gz)
tar -xzf "$archive" -C "$dir/sdist" "$top/vendor/llama.cpp/convert_hf_to_gguf.py" \
    "$top/vendor/llama.cpp/conversion" "$top/vendor/llama.cpp/gguf-py"
rm -rf "$dir/llama.cpp" && mv "$dir/sdist/$top/vendor/llama.cpp" "$dir/llama.cpp"
glibc=$(ldd --version | head -1 | grep -oE '[0-9]+\.[0-9]+$')
if [ "$(printf '%s\n2.38\n' "$glibc" | sort -V | head -1)" != "2.38" ]; then
    echo "glibc $glibc < 2.38: marking the runtime's need of GLIBC_2.38 weak and building $dir/libisoc23.so"
    "$python" "$here/weak_glibc_2_38.py" "$dir"/runtime/llama_cpp_py_sync/*.so*
    gcc -O2 -shared -fPIC -o "$dir/libisoc23.so" "$here/isoc23.c"
    echo "run bench/bench_llama_cpp.py with --preload $dir/libisoc23.so"
fi
echo "--runtime $dir/runtime --converter $dir/llama.cpp/convert_hf_to_gguf.py"
