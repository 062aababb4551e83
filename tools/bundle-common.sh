# Sourced by tools/gpu-bench.sh and tools/bench-16core/bundle.sh, which pack
# what a lent machine without Rust or DPDK needs.

# bundle_libs DIR FILE...: copies into DIR every shared library the FILEs
# load, except the C library's own (the target machine has those).
bundle_libs() {
  local dir=$1
  shift
  for f in "$@"; do
    ldd "$f" 2>/dev/null | awk '/=> \//{print $3}'
  done | sort -u | grep -vE '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*)\.so' | while read -r l; do
    cp -L "$l" "$dir/"
  done
}

# bundle_phub_py DIR: copies the Python package phub (abi3, with its
# compiled extension) from target/torch-venv or target/python-venv into DIR.
bundle_phub_py() {
  local site
  site=$(ls -d target/torch-venv/lib/python3*/site-packages/phub target/python-venv/lib/python3*/site-packages/phub \
    2>/dev/null | head -1 || true)
  test -n "$site" || { echo "phub is installed in neither target/torch-venv nor target/python-venv: make python-venv" >&2; return 1; }
  cp -r "$site" "$1/"
  rm -rf "$1/phub/__pycache__"
}
