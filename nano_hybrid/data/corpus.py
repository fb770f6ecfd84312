"""A deduplicated text corpus from directory trees (e.g. a host's installed Python packages), with whole packages
held out as the validation split, written as Megatron indexed datasets plus a manifest that rebuilds and checks it.

    build_corpus(CorpusSettings(roots=("/usr/lib/python3.12",), ...), "data/corpus/site", spec, workers=16)
    check_corpus("data/corpus/site")          # rescan the roots and rehash the outputs against the manifest

Selection, in this order, for every regular file under each root (``os.walk``, sorted, symlinks not followed):
1. ``include`` / ``exclude``: ``fnmatch`` patterns (case-sensitive) on the path relative to its root, where ``*``
   also matches ``/`` (``*.py`` is every .py file at any depth; ``*/tests/*`` every file under a tests folder
   below the top level). A file is taken when it matches an include pattern and no exclude pattern.
2. Size: ``min_bytes <= size <= max_bytes``.
3. Text: UTF-8 without NUL bytes (anything else is skipped as binary / not UTF-8). Paths holding a tab, newline
   or an undecodable byte are skipped (they cannot be written to the per-file table).
4. Deduplication by content: ``exact`` (sha256 of the bytes) or ``whitespace`` (sha256 of the text with every run
   of whitespace collapsed to one space); the first file in walk order (roots in the given order) is kept.

A file's package is the first component of its path under the root (a file directly under the root is its own
package, named by its stem: ``six.py`` -> ``six``); the same name under two roots is one package. The validation
split is a set of whole packages: the ``valid_packages`` named (each must exist), or, with ``valid_fraction``,
the packages in the order of the sha256 of their names, each taken while the taken bytes stay within
``valid_fraction`` of all kept bytes (deterministic, independent of the walk order). Every other package is
training data. No content is in both splits: deduplication runs over all roots before the split.

Each kept file is one document (``eod`` appended with ``append_eod``), tokenized in ``workers`` processes in walk
order: the byte tokenizer sees the raw bytes, the BPE tokenizers the UTF-8 text. A worker rehashes the bytes it
reads: a file that changed since the scan stops the build. Output folder:
``train.bin/.idx/.json``, ``valid.bin/.idx/.json`` (prefixes ``<out>/train``, ``<out>/valid``; the .json records
the tokenizer type as prepare_data's do), ``files.tsv`` (one row per kept file: root index, path, package, bytes,
sha256, split, tokens) and ``manifest.json`` (settings, skip counts, per-package and per-split totals, the sha256
of every output file and ``content_sha256``). It is built in a temporary sibling folder and published by rename.

``content_sha256`` is the sha256 of the corpus identity: the selection settings (not the roots' locations), the
held-out package list, the tokenizer (type, settings, sha256 of its file), ``append_eod``, the kept files' rows
(root index, path, package, bytes, sha256, split) and the sha256 of the four .bin/.idx files. It does not depend
on the worker count, the timing or where the roots are mounted. ``check_corpus`` recomputes it from the trees
and the output files and names what differs.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import multiprocessing
import os
import shutil
import stat
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from nano_hybrid.data.prepare import DataPreparationError
from nano_hybrid.data.tokenizer import TokenizerError, TokenizerSpec, build_tokenizer

FORMAT = "nano_hybrid.corpus/1"
DEFAULT_INCLUDE = ("*.py", "*.pyi", "*.md", "*.rst", "*.txt")
DEFAULT_EXCLUDE = ("*__pycache__/*", "*.dist-info/*", "*.egg-info/*")
SPLITS = ("train", "valid")
DEDUP_MODES = ("exact", "whitespace")
TABLE_COLUMNS = ("root", "path", "package", "bytes", "sha256", "split", "tokens")
SKIP_REASONS = ("excluded", "not_regular", "too_small", "too_large", "binary", "not_utf8", "bad_name", "duplicate")


class CorpusError(DataPreparationError):
    """Bad corpus settings or input (missing root, nothing matched, unknown package): before any work."""


class CorpusCheckError(RuntimeError):
    """The corpus on disk or its source trees differ from its manifest."""


@dataclass(frozen=True)
class CorpusSettings:
    roots: tuple[str, ...]
    include: tuple[str, ...] = DEFAULT_INCLUDE
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    min_bytes: int = 32
    max_bytes: int = 1_000_000
    dedup: str = "exact"
    valid_packages: tuple[str, ...] = ()
    valid_fraction: float | None = None
    append_eod: bool = True

    def validate(self) -> None:
        if not self.roots:
            raise CorpusError("give at least one root folder")
        for r in self.roots:
            if not Path(r).is_dir():
                raise CorpusError(f"root not found (or not a folder): {r}")
        if not self.include:
            raise CorpusError("no include patterns")
        if not 0 <= self.min_bytes <= self.max_bytes:
            raise CorpusError(f"size limits must satisfy 0 <= min_bytes ({self.min_bytes}) <= max_bytes ({self.max_bytes})")
        if self.dedup not in DEDUP_MODES:
            raise CorpusError(f"dedup={self.dedup!r}; choose one of {', '.join(DEDUP_MODES)}")
        if bool(self.valid_packages) == (self.valid_fraction is not None):
            raise CorpusError("hold out validation packages by name or by fraction: give exactly one of the two")
        if self.valid_fraction is not None and not 0 < self.valid_fraction < 1:
            raise CorpusError(f"valid_fraction={self.valid_fraction} must be in (0, 1)")

    def identity(self) -> dict:
        """The settings that decide the corpus' content (the roots' locations are not among them)."""
        d = asdict(self)
        d.pop("roots")
        d["num_roots"] = len(self.roots)
        return d


@dataclass
class FileRow:
    root: int
    path: str
    package: str
    size: int
    sha256: str
    split: str = ""
    tokens: int = -1

    def source_fields(self) -> str:
        return f"{self.root}\t{self.path}\t{self.package}\t{self.size}\t{self.sha256}\t{self.split}"


@dataclass
class Scan:
    rows: list[FileRow]
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))
    candidates: int = 0


def package_of(rel: str) -> str:
    head, sep, _ = rel.partition("/")
    return head if sep else Path(rel).stem


def _matches(rel: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(rel, p) for p in patterns)


def scan(settings: CorpusSettings) -> Scan:
    """Select, read, hash and deduplicate the files under ``settings.roots`` (no split assigned yet)."""
    settings.validate()
    out = Scan(rows=[])
    seen: set[str] = set()
    for ri, root in enumerate(settings.roots):
        root = os.path.abspath(root)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, root)
            for name in sorted(filenames):
                rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
                if not _matches(rel, settings.include):
                    continue
                out.candidates += 1
                if _matches(rel, settings.exclude):
                    out.skipped["excluded"] += 1
                    continue
                if any(c in rel for c in "\t\n\r"):
                    out.skipped["bad_name"] += 1
                    continue
                try:
                    rel.encode("utf-8")
                except UnicodeEncodeError:
                    out.skipped["bad_name"] += 1
                    continue
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                    if not stat.S_ISREG(st.st_mode):
                        out.skipped["not_regular"] += 1
                        continue
                    if st.st_size < settings.min_bytes:
                        out.skipped["too_small"] += 1
                        continue
                    if st.st_size > settings.max_bytes:
                        out.skipped["too_large"] += 1
                        continue
                    raw = Path(path).read_bytes()
                except OSError as e:
                    raise CorpusError(f"cannot read {path}: {e.strerror or e}") from None
                if not settings.min_bytes <= len(raw) <= settings.max_bytes:  # changed while scanning
                    out.skipped["too_small" if len(raw) < settings.min_bytes else "too_large"] += 1
                    continue
                if b"\0" in raw:
                    out.skipped["binary"] += 1
                    continue
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError:
                    out.skipped["not_utf8"] += 1
                    continue
                digest = hashlib.sha256(raw).hexdigest()
                key = digest if settings.dedup == "exact" else hashlib.sha256(b" ".join(raw.split())).hexdigest()
                if key in seen:
                    out.skipped["duplicate"] += 1
                    continue
                seen.add(key)
                out.rows.append(FileRow(ri, rel, package_of(rel), len(raw), digest))
    if not out.rows:
        raise CorpusError(
            f"no files to take under {', '.join(settings.roots)}: {out.candidates} match --include "
            f"{' '.join(settings.include)}; skipped {_skip_text(out.skipped)}"
        )
    return out


def _skip_text(skipped: dict[str, int]) -> str:
    parts = [f"{n} {k.replace('_', ' ')}" for k, n in skipped.items() if n]
    return ", ".join(parts) if parts else "none"


def _name_order(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


def choose_valid_packages(rows: list[FileRow], settings: CorpusSettings) -> list[str]:
    """The held-out packages (sorted): the named ones, or the hash-ordered ones within ``valid_fraction`` of bytes."""
    sizes: dict[str, int] = {}
    for r in rows:
        sizes[r.package] = sizes.get(r.package, 0) + r.size
    if settings.valid_packages:
        missing = [p for p in settings.valid_packages if p not in sizes]
        if missing:
            known = ", ".join(sorted(sizes)[:12]) + (", ..." if len(sizes) > 12 else "")
            raise CorpusError(f"validation package(s) not in the corpus: {', '.join(missing)} (packages: {known})")
        chosen = sorted(set(settings.valid_packages))
    else:
        budget = settings.valid_fraction * sum(sizes.values())
        chosen, taken = [], 0
        for name in sorted(sizes, key=_name_order):
            if taken + sizes[name] <= budget:
                chosen.append(name)
                taken += sizes[name]
        if not chosen:
            raise CorpusError(
                f"valid_fraction={settings.valid_fraction} holds out no package: every package is larger than "
                f"{budget:,.0f} bytes (raise the fraction or name the packages)"
            )
        chosen.sort()
    if len(chosen) == len(sizes):
        raise CorpusError("every package is held out for validation: the training split would be empty")
    return chosen


def assign_splits(rows: list[FileRow], valid: list[str]) -> None:
    held = set(valid)
    for r in rows:
        r.split = "valid" if r.package in held else "train"


def tokenizer_identity(spec: TokenizerSpec) -> dict:
    ident = {"type": spec.type}
    if spec.type == "byte":
        return ident
    ident.update(vocab_size=spec.vocab_size, num_special_tokens=spec.num_special_tokens, pattern=spec.pattern)
    p = Path(spec.path)
    files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + _file_sha256(f).encode() + b"\n")
    ident["file_sha256"] = h.hexdigest()
    return ident


def _file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def content_sha256(identity: dict, valid: list[str], tok_ident: dict, rows: list[FileRow], outputs: dict) -> str:
    h = hashlib.sha256()
    head = {"format": FORMAT, "settings": identity, "valid_packages": valid, "tokenizer": tok_ident,
            "outputs": {k: outputs[k] for k in sorted(outputs)}}
    h.update(json.dumps(head, sort_keys=True, separators=(",", ":")).encode())
    for r in rows:
        h.update(b"\n" + r.source_fields().encode("utf-8"))
    return h.hexdigest()


def _output_hashes(folder: Path) -> dict:
    return {f"{s}{ext}": _file_sha256(folder / f"{s}{ext}") for s in SPLITS for ext in (".bin", ".idx")}


# ------------------------------------------------------------------------------ tokenization (workers)
_TOKENIZER = None
_SETTINGS: dict = {}


def _init_worker(spec: TokenizerSpec, append_eod: bool) -> None:
    global _TOKENIZER
    _TOKENIZER = build_tokenizer(spec)
    _SETTINGS["append_eod"] = append_eod


def _tokenize_file(task: tuple[str, str]):
    path, digest = task
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        return None, f"cannot read {path}: {e.strerror or e}"
    if hashlib.sha256(raw).hexdigest() != digest:
        return None, f"{path} changed while the corpus was built (its sha256 differs from the scan's)"
    tok = _TOKENIZER
    ids = tok.tokenize(raw if type(tok).__name__ == "ByteTokenizer" else raw.decode("utf-8"))
    ids = np.asarray(ids, dtype=np.int32)
    if ids.size and _SETTINGS["append_eod"]:
        ids = np.append(ids, np.int32(tok.eod))
    return ids, None


def _pool_context():
    torch = sys.modules.get("torch")
    cuda_up = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
    return multiprocessing.get_context("fork" if sys.platform == "linux" and not cuda_up else "spawn")


# ------------------------------------------------------------------------------ build
def build_corpus(settings: CorpusSettings, out_dir: str | Path, tokenizer: TokenizerSpec, *, workers: int = 1,
                 force: bool = False, log=None) -> dict:
    """Scan, deduplicate, split, tokenize and write the corpus folder ``out_dir``; returns the manifest."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    say = log or (lambda msg: None)
    out_dir = Path(out_dir)
    if not isinstance(workers, int) or workers < 1:
        raise CorpusError(f"workers must be a positive integer, got {workers!r}")
    if out_dir.exists() and not force:
        raise CorpusError(f"{out_dir} exists (check it with --check, or rebuild it with --force)")
    if out_dir.exists():  # --force replaces a corpus folder, and nothing else
        if not out_dir.is_dir() or not (out_dir / "manifest.json").is_file():
            raise CorpusError(f"{out_dir} exists and is not a corpus folder (no manifest.json): --force replaces only "
                              "a corpus this tool wrote; choose another --output")
    out_real = out_dir.resolve()
    for root in settings.roots:
        r = Path(root).resolve()
        if r == out_real or out_real in r.parents:
            raise CorpusError(f"--output {out_dir} holds --root {root}: the corpus folder must not contain its "
                              "sources")
    try:
        tokenizer.check_files()
        main_tok = build_tokenizer(tokenizer)
    except TokenizerError as e:
        raise CorpusError(str(e)) from None
    t0 = time.perf_counter()
    found = scan(settings)
    valid = choose_valid_packages(found.rows, settings)
    assign_splits(found.rows, valid)
    say(f"corpus: {len(found.rows):,} files kept of {found.candidates:,} matched ({_skip_text(found.skipped)} "
        f"skipped); {len(valid)} package(s) held out for validation; tokenizing with {workers} worker(s)")
    tok_ident = tokenizer_identity(tokenizer)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    dtype = DType.optimal_dtype(main_tok.vocab_size)
    pool = None
    try:
        builders = {s: IndexedDatasetBuilder(str(tmp / f"{s}.bin"), dtype=dtype) for s in SPLITS}
        tasks = [(os.path.join(os.path.abspath(settings.roots[r.root]), r.path), r.sha256) for r in found.rows]
        results, pool = _tokenized(tasks, tokenizer, settings.append_eod, workers)
        for row, (ids, err) in zip(found.rows, results):
            if err is not None:
                raise CorpusError(err)
            row.tokens = int(ids.size)
            if ids.size:
                builders[row.split].add_document(ids, [ids.size])
        for s in SPLITS:
            builders[s].finalize(str(tmp / f"{s}.idx"))
        totals = _split_totals(found.rows)
        for s in SPLITS:
            if totals[s]["tokens"] == 0:
                raise CorpusError(f"the {s} split holds no tokens")
        outputs = _output_hashes(tmp)
        table = _write_tables(tmp, found.rows, totals, tokenizer, main_tok)
        seconds = time.perf_counter() - t0
        manifest = {
            "format": FORMAT,
            "roots": [os.path.abspath(r) for r in settings.roots],
            "settings": settings.identity(),
            "tokenizer": {**tok_ident, "path": tokenizer.path, "describe": main_tok.describe(),
                          "dtype": np.dtype(dtype).name},
            "valid_packages": valid,
            "valid_method": ("named" if settings.valid_packages else
                             f"packages in sha256-of-name order within {settings.valid_fraction} of the kept bytes"),
            "files_matched": found.candidates,
            "files_kept": len(found.rows),
            "skipped": found.skipped,
            "splits": totals,
            "packages": _package_table(found.rows),
            "files_table": "files.tsv",
            "files_table_sha256": hashlib.sha256(table.encode("utf-8")).hexdigest(),
            "outputs_sha256": outputs,
            "content_sha256": content_sha256(settings.identity(), valid, tok_ident, found.rows, outputs),
            "build": {"workers": workers, "seconds": round(seconds, 2), "python": sys.version.split()[0],
                      "tokens_per_s": round(sum(t["tokens"] for t in totals.values()) / max(seconds, 1e-9), 1)},
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _tokenized(tasks: list, tokenizer: TokenizerSpec, append_eod: bool, workers: int):
    """(results, pool): each task's (ids, error), in order, from this process (workers=1, pool None) or a pool of
    ``workers`` processes (the caller terminates it)."""
    if workers == 1:
        _init_worker(tokenizer, append_eod)
        return map(_tokenize_file, tasks), None
    pool = _pool_context().Pool(workers, initializer=_init_worker, initargs=(tokenizer, append_eod))
    return pool.imap(_tokenize_file, tasks, chunksize=16), pool


def _write_tables(tmp: Path, rows: list[FileRow], totals: dict, tokenizer: TokenizerSpec, main_tok) -> str:
    """``files.tsv`` (returned) and each split's ``<split>.json`` in the folder being built."""
    table = "\t".join(TABLE_COLUMNS) + "\n" + "".join(f"{r.source_fields()}\t{r.tokens}\n" for r in rows)
    (tmp / "files.tsv").write_text(table, encoding="utf-8")
    for s in SPLITS:  # read by the trainer's tokenizer check (nano_hybrid.data.prepare.corpus_tokenizer_type)
        (tmp / f"{s}.json").write_text(json.dumps(
            {"prefix": s, "tokenizer_type": tokenizer.type, "tokenizer": main_tok.describe(),
             "documents": totals[s]["files"], "tokens": totals[s]["tokens"]}, indent=1) + "\n")
    return table


def _split_totals(rows: list[FileRow]) -> dict:
    totals = {s: {"prefix": s, "files": 0, "packages": 0, "bytes": 0, "tokens": 0} for s in SPLITS}
    packages: dict[str, set] = {s: set() for s in SPLITS}
    for r in rows:
        t = totals[r.split]
        t["files"] += 1
        t["bytes"] += r.size
        t["tokens"] += max(r.tokens, 0)
        packages[r.split].add(r.package)
    for s in SPLITS:
        totals[s]["packages"] = len(packages[s])
    return totals


def _package_table(rows: list[FileRow]) -> dict:
    """package -> [split, files, bytes, tokens]."""
    table: dict[str, list] = {}
    for r in rows:
        e = table.setdefault(r.package, [r.split, 0, 0, 0])
        e[1] += 1
        e[2] += r.size
        e[3] += max(r.tokens, 0)
    return dict(sorted(table.items()))


# ------------------------------------------------------------------------------ check
def load_manifest(folder: str | Path) -> dict:
    p = Path(folder) / "manifest.json"
    if not p.is_file():
        raise CorpusError(f"no corpus manifest at {p}")
    try:
        m = json.loads(p.read_text())
    except ValueError as e:
        raise CorpusError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CorpusError(f"{p} is not a {FORMAT} manifest")
    return m


def read_table(folder: str | Path) -> list[FileRow]:
    lines = (Path(folder) / "files.tsv").read_text(encoding="utf-8").splitlines()
    if not lines or tuple(lines[0].split("\t")) != TABLE_COLUMNS:
        raise CorpusError(f"{folder}/files.tsv has no {' '.join(TABLE_COLUMNS)} header")
    rows = []
    for line in lines[1:]:
        root, path, package, size, digest, split, tokens = line.split("\t")
        rows.append(FileRow(int(root), path, package, int(size), digest, split, int(tokens)))
    return rows


def settings_from_manifest(manifest: dict, roots: list[str] | None = None) -> CorpusSettings:
    s = dict(manifest["settings"])
    n = s.pop("num_roots")
    roots = list(roots) if roots else list(manifest["roots"])
    if len(roots) != n:
        raise CorpusError(f"the corpus was built from {n} root(s), {len(roots)} given")
    for k in ("include", "exclude", "valid_packages"):
        s[k] = tuple(s[k])
    return CorpusSettings(roots=tuple(roots), **s)


def check_corpus(folder: str | Path, roots: list[str] | None = None) -> dict:
    """Rescan the source trees and rehash the outputs of the corpus at ``folder``; raise CorpusCheckError naming
    what differs from the manifest (changed, added, removed files; output files), else return a summary."""
    folder = Path(folder)
    manifest = load_manifest(folder)
    settings = settings_from_manifest(manifest, roots)
    recorded = read_table(folder)
    found = scan(settings)
    assign_splits(found.rows, list(manifest["valid_packages"]))
    old = {(r.root, r.path): r for r in recorded}
    new = {(r.root, r.path): r for r in found.rows}
    changed = sorted(k for k in old.keys() & new.keys() if old[k].source_fields() != new[k].source_fields())
    added, removed = sorted(new.keys() - old.keys()), sorted(old.keys() - new.keys())
    problems = []
    for label, keys in (("changed", changed), ("added", added), ("removed", removed)):
        if keys:
            first = ", ".join(p for _, p in keys[:3]) + (", ..." if len(keys) > 3 else "")
            problems.append(f"{len(keys)} file(s) {label} ({first})")
    missing = [f"{s}{ext}" for s in SPLITS for ext in (".bin", ".idx") if not (folder / f"{s}{ext}").is_file()]
    if missing:
        problems.append(f"output file(s) missing: {', '.join(missing)}")
        outputs = {}
    else:
        outputs = _output_hashes(folder)
        bad = [k for k, v in manifest["outputs_sha256"].items() if outputs.get(k) != v]
        if bad:
            problems.append(f"output file(s) differ from the manifest: {', '.join(sorted(bad))}")
    if not problems:
        digest = content_sha256(settings.identity(), list(manifest["valid_packages"]),
                                {k: v for k, v in manifest["tokenizer"].items() if k not in ("path", "describe", "dtype")},
                                found.rows, outputs)
        if digest != manifest["content_sha256"]:
            problems.append(f"content_sha256 {digest[:12]} differs from the manifest's {manifest['content_sha256'][:12]}")
    if problems:
        raise CorpusCheckError(f"corpus {folder} does not match its manifest: {'; '.join(problems)}")
    return {"corpus": str(folder), "ok": True, "files": len(found.rows), "content_sha256": manifest["content_sha256"],
            "tokens": {s: manifest["splits"][s]["tokens"] for s in SPLITS}}
