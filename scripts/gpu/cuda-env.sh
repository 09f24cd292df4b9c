# The CUDA libraries for the harvester, sourced by run.sh and profile.sh on the GPU machine:
# lists every folder that holds one (with `ls -l` of each library) into $out/env.txt, and puts
# one folder for cuBLAS, cuBLASLt, NVRTC and NVRTC's builtins on LD_LIBRARY_PATH (never two
# installs mixed): a toolkit whose version matches the driver's CUDA first, then any folder
# that holds all four; then the driver's folder. Sets `chosen` and `driver_dir`, and lists every
# folder in HARVEST_CUDA_LIBRARY_PATH for the harvester's own choice.
driver_cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -1)
# Every folder that holds a CUDA library, with `ls -l` of each library in it.
candidates=$( {
  ls -d /usr/local/cuda-*/targets/x86_64-linux/lib /usr/local/cuda-*/lib64 \
    /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda/lib64 2>/dev/null
  for py in python3 /opt/torch/.venv/bin/python3; do
    command -v "$py" >/dev/null 2>&1 && "$py" - <<'PY' 2>/dev/null
import glob, os, site
for root in site.getsitepackages():
  for lib in sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib"))):
      print(lib)
PY
  done
  ldconfig -p 2>/dev/null | awk '/libcuda\.so|libcublas|libnvrtc/ {print $NF}' | xargs -r -n1 dirname
  ls -d /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu 2>/dev/null
} | awk '!seen[$0]++')
echo "-- CUDA libraries found" | tee -a "$out/env.txt"
for d in $candidates; do
  ls -l "$d"/libcuda.so* "$d"/libcublas*.so* "$d"/libnvrtc*.so* "$d"/libnvJitLink*.so* 2>/dev/null
  [ -f "$d/../version.json" ] && echo "   $d: toolkit $(grep -m1 -A1 '"cuda"' "$d/../version.json" | sed -n 's/.*"version" *: *"\([^"]*\)".*/\1/p')"
done | tee -a "$out/env.txt"
# One folder for cuBLAS, cuBLASLt, NVRTC and NVRTC's builtins, never two installs mixed:
# a toolkit whose version matches the driver's CUDA first, then any folder that holds all four.
has_all() { ls "$1"/libcublas.so.1[0-9]* "$1"/libcublasLt.so.1[0-9]* "$1"/libnvrtc.so.1[0-9]* \
  "$1"/libnvrtc-builtins.so.1[0-9]* >/dev/null 2>&1; }
chosen=
for d in $candidates; do
  v=$(sed -n 's/.*"version" *: *"\([0-9]*\.[0-9]*\).*/\1/p' "$d/../version.json" 2>/dev/null | head -1)
  if [ -n "$v" ] && [ "$v" = "$driver_cuda" ] && has_all "$d"; then chosen=$d; break; fi
done
if [ -z "$chosen" ]; then
  for d in $candidates; do has_all "$d" && { chosen=$d; break; }; done
fi
driver_dir=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 / {print $NF; exit}' | xargs -r dirname)
[ -z "$driver_dir" ] && [ -e /usr/local/nvidia/lib64/libcuda.so.1 ] && driver_dir=/usr/local/nvidia/lib64
export LD_LIBRARY_PATH=${chosen}${driver_dir:+:$driver_dir}
# The harvester's own search (backend/cuda/libraries.rs) gets every folder found, and picks the
# CUDA major the driver runs from them.
HARVEST_CUDA_LIBRARY_PATH=$(echo $candidates | tr ' ' ':')
export HARVEST_CUDA_LIBRARY_PATH
