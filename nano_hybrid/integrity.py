"""Checksums of checkpoint files: CRC-32 per 64 MiB chunk, computed by a thread pool.

``zlib.crc32`` runs at several GB/s per core and releases the GIL, so the chunks of all files of a
checkpoint are checksummed in parallel threads; reading the files is usually the limit. The per-chunk
values also locate a damaged byte range. The completion manifest (``nano_hybrid_checkpoint.json``)
stores, for every other file of the checkpoint directory, ``{"size": bytes, "crc32": [hex per chunk]}``.

    python -m nano_hybrid.integrity runs/x/checkpoints/iter_0000100   # checksum throughput of a checkpoint
"""

from __future__ import annotations

import os
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nano_hybrid.errors import EXIT_BAD_INPUT

ALGORITHM = "crc32/64MiB"
CHUNK = 64 * 2**20  # bytes per checksum value
READ = 8 * 2**20  # bytes read at a time (per thread memory)


def default_workers() -> int:
    return max(1, min(16, os.cpu_count() or 1))


def list_files(root: str | Path, exclude: tuple[str, ...] = ()) -> list[str]:
    """Every regular file under ``root`` (relative POSIX paths, sorted), minus ``exclude``."""
    root = Path(root)
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = (Path(dirpath) / n).relative_to(root).as_posix()
            if rel not in exclude and (Path(dirpath) / n).is_file():
                out.append(rel)
    return sorted(out)


def _crc_chunk(path: Path, offset: int, length: int) -> tuple[int, int]:
    """(crc32 of bytes [offset, offset+length), bytes actually read)."""
    crc, done = 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while done < length:
            buf = os.pread(fd, min(READ, length - done), offset + done)
            if not buf:
                break
            crc = zlib.crc32(buf, crc)
            done += len(buf)
    finally:
        os.close(fd)
    return crc, done


def checksum_files(root: str | Path, relpaths: list[str], workers: int | None = None) -> dict[str, dict]:
    """``{relpath: {"size": n, "crc32": [8-hex-digit value per 64 MiB chunk]}}`` for files under ``root``."""
    root = Path(root)
    sizes = {r: (root / r).stat().st_size for r in relpaths}
    tasks = [(r, off, min(CHUNK, sizes[r] - off)) for r in relpaths for off in range(0, max(sizes[r], 1), CHUNK)]
    with ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
        results = list(pool.map(lambda t: _crc_chunk(root / t[0], t[1], t[2]), tasks))
    out: dict[str, dict] = {r: {"size": sizes[r], "crc32": []} for r in relpaths}
    for (r, off, length), (crc, done) in zip(tasks, results):
        if done != length:
            raise OSError(f"{root / r}: changed size while being checksummed (read {done} of {length} bytes at {off})")
        out[r]["crc32"].append(f"{crc:08x}")
    return out


def verify_files(root: str | Path, expected: dict[str, dict], workers: int | None = None) -> str | None:
    """None when every file in ``expected`` exists with its size and checksums; else one line naming the file."""
    root = Path(root)
    for rel, e in sorted(expected.items()):
        f = root / rel
        if not f.is_file():
            return f"{f}: missing"
        size = f.stat().st_size
        if size != e["size"]:
            return f"{f}: {size} bytes, the manifest says {e['size']} (truncated or incomplete file)"
    got = checksum_files(root, sorted(expected), workers)
    for rel, e in sorted(expected.items()):
        for i, (a, b) in enumerate(zip(got[rel]["crc32"], e["crc32"])):
            if a != b:
                lo, hi = i * CHUNK, min((i + 1) * CHUNK, e["size"]) - 1
                return f"{root / rel}: checksum mismatch in bytes {lo}-{hi} (corrupt file)"
    return None


def measure(root: str | Path, workers: int | None = None) -> dict:
    """Checksum every file under ``root`` once; bytes, seconds and GB/s."""
    files = list_files(root)
    t0 = time.perf_counter()
    sums = checksum_files(root, files, workers)
    dt = time.perf_counter() - t0
    nbytes = sum(v["size"] for v in sums.values())
    return {"dir": str(root), "files": len(files), "bytes": nbytes, "seconds": dt, "gb_per_s": nbytes / max(dt, 1e-9) / 1e9,
            "workers": workers or default_workers(), "algorithm": ALGORITHM}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Checksum throughput over a checkpoint directory (what a save and a load add).")
    p.add_argument("dir", help="a checkpoint directory, e.g. runs/x/checkpoints/iter_0000100")
    p.add_argument("--workers", type=int, default=None, help=f"threads (default {default_workers()})")
    p.add_argument("--repeat", type=int, default=2, help="passes (the first may read from disk, later ones from the page cache)")
    a = p.parse_args(argv)
    if not Path(a.dir).is_dir():
        print(f"error: {a.dir}: no such directory", file=sys.stderr)
        return EXIT_BAD_INPUT
    for i in range(a.repeat):
        r = measure(a.dir, a.workers)
        print(f"pass {i + 1}: {r['files']} files, {r['bytes'] / 1e9:.2f} GB in {r['seconds']:.2f} s = "
              f"{r['gb_per_s']:.2f} GB/s ({r['algorithm']}, {r['workers']} threads)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
