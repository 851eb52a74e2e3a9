#!/usr/bin/env bash
# FlashAttention 4 (`flash_attn.cute`) for the GPU machine, which has no network and takes at most
# 64 MiB of carried files per device call: its wheels are ~102 MB (nvidia-cutlass-dsl-libs-cu13
# alone is 92 MB), so they travel as one tar cut into parts of PART_MIB (default 39) MiB, one
# part per carry folder (.fa4a/, .fa4b/, ...), sent in consecutive calls while the machine is warm
# (/tmp persists between calls until it goes idle), then joined, checked and installed there.
#
# Pins (python 3.12, torch 2.11 + CUDA 13 image; read from each wheel's METADATA):
#   flash-attn-4 4.0.0b36 needs nvidia-cutlass-dsl>=4.6.2, apache-tvm-ffi>=0.1.11,<0.2,
#     torch-c-dlpack-ext, quack-kernels>=0.5.3, einops, typing_extensions (in the image);
#   nvidia-cutlass-dsl 4.8.1 is a stub whose .pth adds nvidia_cutlass_dsl/dsl_packages to sys.path
#     and needs libs-base==4.8.1 plus one CUDA flavour: we take libs-cu13 (not its default cu12);
#     since 4.6 the Python DSL itself (cutlass/__init__.py, cutlass/cute/, base_dsl/) is
#     nvidia-cutlass-dsl-libs-core (py3-none-any, a requirement of libs-base): libs-base holds only
#     cutlass/_mlir*, libs-cu13 the compiled MLIR module and runtime. All three share the
#     nvidia_cutlass_dsl/ folder, so they install in one pip call into an empty --target.
#     `--target` installs skip .pth files, so the install step exports that folder on PYTHONPATH;
#   libs-base/libs-core also need cuda-bindings>=12.8 (torch 2.11 requires cuda-bindings>=13.0.3,
#     <14 and its cuda-pathfinder: in the image) and protobuf (not imported by `cutlass`, nor by
#     flash_attn or quack: not shipped);
#   quack-kernels 0.6.5 needs nvidia-cutlass-dsl>=4.7, apache-tvm-ffi>=0.1.6,<0.2, einops;
#   torch-c-dlpack-ext 0.1.5 ships prebuilt addons up to torch 2.9 only: on torch 2.11 tvm-ffi
#     finds torch's own DLPack exchange API and skips it (kept because flash-attn-4 lists it).
# Checked without CUDA (imports need no GPU): `import cutlass.cute` with these cp312 wheels on
# python 3.12, `from flash_attn.cute import flash_attn_varlen_func` with the same pins' cp311
# wheels on python 3.11 + torch 2.13 CPU, both installed with --target as below.
#
# On this machine (reaches PyPI), from the checkout root:
#   bash tests/gpu/fa4_wheels.sh            # -> .fa4/ (wheels), .fa4a/ .fa4b/ .fa4c/ (parts)
# Each part folder holds fa4.tar.partNN, its own fa4.tar.partNN.sha256 and fa4.tar.sha256 (the
# joined tar's sum, the same in every folder). Then the device calls, in order, while the machine
# stays warm (carry paths are ignored by git through .git/info/exclude; the last part is the
# smallest, so it rides with the other carries):
#   1. carry [".fa4a"]  command: mkdir -p /tmp/fa4parts && cp .fa4a/* /tmp/fa4parts/ && ls -l /tmp/fa4parts
#   2. carry [".fa4b"]  command: mkdir -p /tmp/fa4parts && cp .fa4b/* /tmp/fa4parts/ && ls -l /tmp/fa4parts
#   3. carry [".fa4c", ".whl", ".gpucarry"] (+ `.mycarry` from a helper's branch)
#      command: mkdir -p /tmp/fa4parts && cp .fa4c/* /tmp/fa4parts/ &&
#               STEPS="fa4-install fa4-tests attn-bench" bash tests/gpu/device_run.sh
# `fa4-install` (tests/gpu/device_run.sh) checks each part's sha256, joins them, checks the tar's,
# installs with --no-index --no-deps --target /tmp/fa4/site-packages (emptied first) and exports
# PYTHONPATH (that folder and its nvidia_cutlass_dsl/dsl_packages) for the steps after it in the
# same call; a later call finds the folder on its own and `fa4-install` is then a no-op.
set -euo pipefail
dest=.fa4
part_mib=${PART_MIB:-39}
pins=(
  flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.1
)
exclude="$(git rev-parse --git-common-dir)/info/exclude"
for d in "$dest" .fa4a .fa4b .fa4c .fa4d; do
  grep -qxF "/$d/" "$exclude" 2>/dev/null || echo "/$d/" >> "$exclude"
done
mkdir -p "$dest"
wheels=()
for p in "${pins[@]}"; do
  python3 -m pip download -q --no-deps --pre --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" "$p" \
    2> >(grep -v "^WARNING: Location" >&2)
  name=${p%%==*}
  found=("$dest/${name//-/_}-${p#*==}-"*.whl)  # only the pinned files, not stale ones in $dest
  [ -f "${found[0]}" ] || { echo "no wheel for $p in $dest" >&2; exit 1; }
  wheels+=("${found[@]##*/}")
done
rm -rf .fa4a .fa4b .fa4c .fa4d "$dest/parts"
mkdir -p "$dest/parts"
(cd "$dest" && tar -cf parts/fa4.tar "${wheels[@]}")
(cd "$dest/parts" && sha256sum fa4.tar > fa4.tar.sha256 \
  && split -b "${part_mib}M" -d -a 2 fa4.tar fa4.tar.part && rm fa4.tar)
letters=(a b c d)
i=0
for part in "$dest"/parts/fa4.tar.part*; do
  [ $i -lt ${#letters[@]} ] || { echo "more than ${#letters[@]} parts: raise PART_MIB" >&2; exit 1; }
  folder=".fa4${letters[$i]}"
  mkdir -p "$folder"
  mv "$part" "$folder/"
  (cd "$folder" && sha256sum "${part##*/}" > "${part##*/}.sha256")
  cp "$dest/parts/fa4.tar.sha256" "$folder/"
  i=$((i + 1))
done
printf '%s\n' "${wheels[@]}"
du -sh .fa4? "$dest"
