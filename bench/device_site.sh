#!/usr/bin/env bash
# Packs the device machine's missing Python packages into one xz tarball of an installed site folder,
# for `carry` in a device call:
#   bash bench/device_site.sh .site.tar.xz            # downloads what the device lacks (below), cp312
#   bash bench/device_site.sh .site.tar.xz .whl ...   # or packs the cp312 wheels in these folders
# bench/device_pending.sh unpacks it into /tmp/site. Why not carry the wheels themselves: a call carries
# at most 64 MiB (the working tree included) and the wheels take ~57 MiB, most of it Ray's three binaries
# with their symbol tables; stripped (`--strip-unneeded` keeps the dynamic symbols that loading needs) and
# compressed with xz the same packages take ~26 MiB, which leaves room for a model handed from one call
# to the next (bench/rl_from_scratch.py --handoff).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: bash bench/device_site.sh OUT.tar.xz [WHEEL_DIR...]" >&2; exit 2; }
out=$(realpath -m "$1")
shift
site=$(mktemp -d)
download=$(mktemp -d)
trap 'rm -rf "$site" "$download"' EXIT
platforms=()
for p in manylinux1 manylinux2010 manylinux2014 manylinux_2_5 manylinux_2_12 manylinux_2_17 manylinux_2_24 \
  manylinux_2_26 manylinux_2_27 manylinux_2_28; do
  platforms+=(--platform "${p}_x86_64")
done
# the device runs CPython 3.12 on x86-64, whatever this machine runs
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 "${platforms[@]}")
if [ $# -eq 0 ]; then
  # what refractor's runs import that the device image (torch 2.11, transformers 5.17) lacks, with
  # everything they need; Ray's Java jars (34 MB) serve only Java workers
  python3 -m pip download -q --disable-pip-version-check --no-cache-dir "${target[@]}" -d "$download" \
    ray==2.60.0 fastapi uvicorn pydantic pyzmq aiohttp httpx msgpack orjson psutil nvidia-ml-py \
    prometheus_client typer rich pyyaml
  # the image's own copies stay: its torch, jax and onnx were built and tested with them
  for name in numpy protobuf typing_extensions packaging filelock; do rm -f "$download/$name"-*.whl; done
  for wheel in "$download"/ray-*.whl; do zip -q -d "$wheel" 'ray/jars/*' || true; done
  set -- "$download"
fi
wheels=()
for dir in "$@"; do wheels+=("$dir"/*.whl); done
python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
  "${target[@]}" --target "$site" "${wheels[@]}"
find "$site" -type f \( -name '*.so' -o -name '*.so.*' -o -perm -u+x \) -exec sh -c \
  'for f; do if head -c 4 "$f" | grep -q ELF; then strip --strip-unneeded "$f"; fi; done' sh {} +
touch "$site/.refractor-wheels"
tar -cf - -C "$site" . | xz -9 -T0 >"$out"
echo "wrote $out ($(du -h "$out" | cut -f1)) from ${#wheels[@]} wheels"
