"""Pack an onnxruntime-gpu wheel for the H200 as one small xz tar (issue 16): what ``scripts/gpu_ort.sh`` unpacks.

The device machine takes at most 62 MiB per part (``../shared/scripts/chunk-for-gpu``) and each part costs a
device call, so the 255 MB wheel is cut to what the CUDA execution provider needs on Hopper:

* the fat binaries of ``libonnxruntime_providers_cuda.so`` keep their sm_90 cubins; every other architecture's
  payload (sm_75 / 80 / 86 / 89 / 120) is zeroed in place (headers kept, so the container stays valid; zeros
  compress to nothing). Kernels built for no sm_90 at all (a few sm_120-only ones) could not run on Hopper anyway;
* dropped: ``libonnxruntime.so`` (the C API library: the Python module links ONNX Runtime statically), the
  TensorRT EP library, and the pure-Python ``transformers`` / ``quantization`` / ``tools`` trees;
* added: ``onnx_graphsurgeon`` from this environment (pure Python; the H200 image lacks it and
  ``export --flavour ort-contrib`` needs it).

The wheel comes from ``pip download`` with the flags in the device README (cp312, manylinux x86_64)::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 -d .ortgpu onnxruntime-gpu==1.31.1
    python3 scripts/pack_ort_gpu.py .ortgpu/onnxruntime_gpu-1.31.1-*.whl .ortgpu/onnxruntime-gpu-1.31.1-sm90.tar.xz \
        --parts 2                                       # -> .c1/part.00, .c2/part.01 (~28.6 MiB each)

The tar is ~57 MiB: one ``chunk-for-gpu`` part, but a call carries the working tree (~8.5 MiB) too and at most
64 MiB in all, so ``--parts 2`` cuts it in halves in ``chunk-for-gpu``'s layout (``.cN/part.NN`` at the
checkout's root, ignored through ``.git/info/exclude``), sent in two back-to-back calls (the second within the
machine's 30 s warm window, or the first part is gone). xz at preset 9e takes several minutes on one core.
"""

from __future__ import annotations

import argparse
import lzma
import struct
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
KEEP_SM = 90
CUDA_LIB = "onnxruntime/capi/libonnxruntime_providers_cuda.so"
DROP = ("onnxruntime/capi/libonnxruntime.so", "onnxruntime/capi/libonnxruntime_providers_tensorrt.so",
        "onnxruntime/transformers/", "onnxruntime/quantization/", "onnxruntime/tools/",
        "onnxruntime/ThirdPartyNotices.txt")


def _section(data: bytearray, name: bytes) -> tuple[int, int]:
    """(file offset, size) of an ELF64 little-endian section by name."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    str_off, = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)
    for i in range(shnum):
        base = shoff + i * shentsize
        name_off, = struct.unpack_from("<I", data, base)
        start = str_off + name_off
        if bytes(data[start:data.index(b"\0", start)]) == name:
            return struct.unpack_from("<Q", data, base + 0x18)[0], struct.unpack_from("<Q", data, base + 0x20)[0]
    raise SystemExit(f"no {name.decode()} section")


def keep_only_sm90(data: bytearray) -> tuple[int, int, int]:
    """Zero every fat-binary entry's payload not built for sm_90 (in place): (fat binaries, bytes kept,
    bytes zeroed). Entry header: kind u16, version u16, header size u32, payload size u64, ..., sm at byte 28."""
    off, size = _section(data, b".nv_fatbin")
    pos, blobs, kept, zeroed = off, 0, 0, 0
    while pos < off + size:
        magic, _version, header, fat = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:  # alignment padding between fat binaries
            pos += 8
            continue
        blobs += 1
        entry, end = pos + header, pos + header + fat
        while entry < end:
            _kind, _ver, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            sm, = struct.unpack_from("<I", data, entry + 28)
            start = entry + entry_header
            if sm == KEEP_SM:
                kept += payload
            else:
                data[start:start + payload] = bytes(payload)
                zeroed += payload
            entry = start + payload
        pos = end
    return blobs, kept, zeroed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheel")
    ap.add_argument("out", help="the .tar.xz to write")
    ap.add_argument("--parts", type=int, default=0,
                    help="also cut it into this many equal parts .c1/part.00 ... at the git checkout's root")
    ap.add_argument("--only-split", action="store_true", help="OUT exists: only cut it into --parts")
    args = ap.parse_args()
    if not args.only_split:
        pack(args.wheel, args.out)
    if args.parts:
        split(Path(args.out), args.parts)
    return 0


def split(path: Path, parts: int) -> None:
    """``path`` in ``parts`` equal pieces, laid out as ``chunk-for-gpu`` lays out its parts (which
    ``scripts/gpu_ort.sh`` joins in order); earlier ``.cN`` folders are replaced."""
    import shutil
    import subprocess

    top = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                              check=True).stdout.strip())
    exclude = top / ".git" / "info" / "exclude"
    listed = exclude.read_text().splitlines() if exclude.exists() else []
    for old in top.glob(".c[0-9]*"):
        if old.is_dir() and old.name[2:].isdigit():
            shutil.rmtree(old)
    data = path.read_bytes()
    size = -(-len(data) // parts)
    for i in range(parts):
        folder = top / f".c{i + 1}"
        folder.mkdir()
        (folder / f"part.{i:02d}").write_bytes(data[i * size:(i + 1) * size])
        if f"/.c{i + 1}/" not in listed:
            listed.append(f"/.c{i + 1}/")
    exclude.write_text("\n".join(listed) + "\n")
    print(f"{parts} parts of {size / 2**20:.1f} MiB in .c1 .. .c{parts} (ignored by git)")


def pack(wheel_path: str, out: str) -> None:
    import onnx_graphsurgeon

    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel_path) as wheel:
        root = Path(tmp)
        for info in wheel.infolist():
            if not info.filename.startswith(DROP):
                wheel.extract(info, root)
        lib = root / CUDA_LIB
        data = bytearray(lib.read_bytes())
        blobs, kept, zeroed = keep_only_sm90(data)
        lib.write_bytes(data)
        print(f"{CUDA_LIB}: {blobs} fat binaries, kept {kept / 1e6:.1f} MB of sm_{KEEP_SM} cubins, zeroed "
              f"{zeroed / 1e6:.1f} MB", flush=True)
        gs_dir = Path(onnx_graphsurgeon.__file__).parent
        with lzma.open(out, "wb", preset=9 | lzma.PRESET_EXTREME) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
            for top in sorted(p for p in root.iterdir()):
                tar.add(top, arcname=top.name, filter=lambda t: None if "__pycache__" in t.name else t)
            tar.add(gs_dir, arcname="onnx_graphsurgeon", filter=lambda t: None if "__pycache__" in t.name else t)
    print(f"wrote {out}: {Path(out).stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    sys.exit(main())
