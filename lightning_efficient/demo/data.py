"""A language-modelling corpus every machine has: the Python standard library's own source files.

Text is tokenized with a byte-level BPE trained by the ``tokenizers`` library on the training
files, and the token ids are cached on disk (keyed by Python version, vocabulary size and a
fingerprint of the files, each cached file checked by its SHA-256), so later runs start in a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from lightning_efficient._validation import require, require_int
from lightning_efficient.resumable import EpochShuffleSampler, ResumableDataLoader

END_OF_TEXT = "<|endoftext|>"
IGNORE_INDEX = -100
_BINARY_PROBE_BYTES = 8192


def default_cache_dir() -> Path:
    """``$LIGHTNING_EFFICIENT_CACHE``, else ``$XDG_CACHE_HOME/lightning_efficient``, else ``~/.cache/...``."""
    if os.environ.get("LIGHTNING_EFFICIENT_CACHE"):
        return Path(os.environ["LIGHTNING_EFFICIENT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning_efficient"


def stdlib_source_files() -> list[Path]:
    """Every ``.py`` file of this interpreter's standard library (site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


_BOMS = (  # longest first: the UTF-32 little-endian BOM starts with the UTF-16 one
    (b"\xff\xfe\x00\x00", "utf-32"),
    (b"\x00\x00\xfe\xff", "utf-32"),
    (b"\xef\xbb\xbf", "utf-8-sig"),
    (b"\xff\xfe", "utf-16"),
    (b"\xfe\xff", "utf-16"),
)


def text_encoding(path: Path) -> str | None:
    """The encoding ``path`` is read with: the one its byte-order mark names (UTF-8, UTF-16, UTF-32),
    else ``"utf-8"`` (undecodable bytes replaced); None for a binary file (a NUL byte in its first
    8 KiB and no byte-order mark)."""
    with open(path, "rb") as handle:
        head = handle.read(_BINARY_PROBE_BYTES)
    for bom, encoding in _BOMS:
        if head.startswith(bom):
            return encoding
    return None if b"\0" in head else "utf-8"


def corpus_files(data_path: str | None) -> list[Path]:
    """The files of the corpus: the standard library when ``data_path`` is None, else the file or
    every text file below the directory, sorted.

    Raises:
        FileNotFoundError: when ``data_path`` does not exist.
        ValueError: when it holds no text file.
    """
    if data_path is None:
        return stdlib_source_files()
    path = Path(data_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data_path {str(path)!r} does not exist")
    if path.is_file():
        return [path]
    files, skipped = [], []
    for candidate in sorted(p for p in path.rglob("*") if p.is_file()):
        (files if text_encoding(candidate) is not None else skipped).append(candidate)
    if skipped:
        shown = ", ".join(str(p.relative_to(path)) for p in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        rank_zero_info(f"data_path {str(path)!r}: skipped {len(skipped)} binary file(s) ({shown})")
    if not files:
        raise ValueError(f"data_path {str(path)!r} holds no text file")
    return files


def split_files(files: list[Path], val_fraction: float, seed: int) -> tuple[list[Path], list[Path]]:
    """A deterministic split by file: a seeded shuffle, then the first ``val_fraction`` for validation."""
    if len(files) < 2:
        return list(files), []
    shuffled = list(files)
    random.Random(seed).shuffle(shuffled)
    n_val = min(len(files) - 1, max(1, round(len(files) * val_fraction)))
    return sorted(shuffled[n_val:]), sorted(shuffled[:n_val])


def _read(path: Path) -> str:
    return path.read_text(encoding=text_encoding(path) or "utf-8", errors="replace")


def _fingerprint(files: list[Path], *settings: object) -> str:
    digest = hashlib.sha256(repr(settings).encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:12]


_CACHE_FILES = ("train.npy", "val.npy", "tokenizer.json")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cache_problem(directory: Path) -> str | None:
    """Why the token cache in ``directory`` cannot be used (missing, unreadable, a file missing or
    failing the SHA-256 recorded in its ``meta.json``), or None when it is intact."""
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        return "no meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as error:
        return f"meta.json unreadable: {error}"
    sums = meta.get("sha256") if isinstance(meta, dict) else None
    if not isinstance(sums, dict):
        return "no checksums in meta.json (an older cache)"
    for name in _CACHE_FILES:
        if not (directory / name).is_file():
            return f"{name} is missing"
        if _sha256(directory / name) != sums.get(name):
            return f"{name} does not match its checksum"
    return None


def add_span_noise(ids: np.ndarray, fraction: float, span: int, vocab_size: int, seed: int) -> np.ndarray:
    """A copy of ``ids`` with about ``fraction`` of it, in spans of ``span`` tokens, replaced by
    uniformly random token ids (deterministic for a seed).

    Raises:
        ValueError: when ``fraction`` > 0 and ``span`` is longer than ``ids`` (no span would fit).
    """
    if fraction > 0 and span > len(ids):
        raise ValueError(
            f"noise_span={span} is longer than the {len(ids)} training tokens: no span of noise fits; "
            f"give a noise_span <= {len(ids)} or noise_fraction=0"
        )
    rng = np.random.default_rng(seed)
    noisy = np.array(ids, copy=True)
    n_spans = len(ids) // span
    chosen = rng.random(n_spans) < fraction
    for start in np.flatnonzero(chosen) * span:
        noisy[start : start + span] = rng.integers(0, vocab_size, span, dtype=noisy.dtype)
    return noisy


class TokenFile:
    """A one-dimensional token-id array in a ``.npy`` file, read a slice at a time with ``os.pread``.

    A memory map of the file would do the same job, but on Linux each page fault maps the pages around it too
    (the kernel's fault-around, 64 KiB), so windows drawn at random grow the process's RSS by up to 64 KiB a
    sample, to the whole file by the end of an epoch: on CPU, where memory is peak RSS, that growth counts as
    training memory (``MemoryReport``, AutoFit's measured peak). Read with ``pread``, the file's pages stay in
    the page cache, outside the process. The descriptor is opened in each process that reads (DataLoader
    workers included) and is not pickled. ``numpy.asarray`` of it reads the whole array.

    Args:
        path: a ``.npy`` file holding a one-dimensional array.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        mapped = np.load(path, mmap_mode="r")
        require(mapped.ndim == 1, "path", str(path), "a .npy file of a one-dimensional array")
        self.path, self.dtype, self.offset, self.length = str(path), mapped.dtype, int(mapped.offset), int(mapped.shape[0])
        del mapped
        self._file: Any = None
        self._pid: int | None = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: slice) -> np.ndarray:
        """The tokens of a slice (step 1), as a new array.

        Raises:
            ValueError: for an index that is not a slice of step 1.
        """
        require(isinstance(index, slice), "index", index, "a slice (TokenFile reads contiguous ranges)")
        start, stop, step = index.indices(self.length)
        require(step == 1, "index", index, "a slice with step 1")
        out = np.empty(max(0, stop - start), dtype=self.dtype)
        self._read_into(memoryview(out).cast("B"), self.offset + start * self.dtype.itemsize)
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        require(copy is not False, "copy", copy, "True or None (the array is read from the file: always a copy)")
        array = self[:]
        return array if dtype is None else array.astype(dtype)

    def _read_into(self, buffer: memoryview, offset: int) -> None:
        """Fill ``buffer`` from the file at ``offset`` (``pread`` reads as many bytes as it can at once)."""
        file = self._opened()
        done = 0
        while done < len(buffer):
            if hasattr(os, "pread"):
                chunk = os.pread(file.fileno(), len(buffer) - done, offset + done)
            else:  # no pread (Windows): this process's own file object, read at a position
                file.seek(offset + done)
                chunk = file.read(len(buffer) - done)
            if not chunk:
                raise EOFError(f"{self.path} ends before byte {offset + len(buffer):,}")
            buffer[done:done + len(chunk)] = chunk
            done += len(chunk)

    def _opened(self) -> Any:
        if self._file is None or self._pid != os.getpid():  # a forked worker opens its own (the parent's stays the parent's)
            self._file, self._pid = open(self.path, "rb", buffering=0), os.getpid()  # noqa: SIM115 - closed with the object
        return self._file

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_file": None, "_pid": None}


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len`` next-token pairs over one token stream.

    The last window is padded: its missing labels are ``-100`` (invalid positions).
    """

    def __init__(self, ids: np.ndarray | TokenFile, seq_len: int, pad_id: int) -> None:
        self.ids = ids
        self.seq_len = seq_len
        self.pad_id = pad_id

    def __len__(self) -> int:
        return max(0, -(-(len(self.ids) - 1) // self.seq_len))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        chunk = torch.from_numpy(self.ids[index * self.seq_len : (index + 1) * self.seq_len + 1].astype(np.int64))
        inputs = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        labels = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        inputs[: len(chunk) - 1] = chunk[:-1]
        labels[: len(chunk) - 1] = chunk[1:]
        return {"input_ids": inputs, "labels": labels}


class CorpusDataModule(LightningDataModule):
    """Next-token prediction over a text corpus, by default the Python standard library's sources.

    Text files are read as UTF-8, or as the UTF-8/16/32 their byte-order mark names; binary files
    below a directory are skipped and listed in one info line. The token cache records a SHA-256
    of each file it holds: a damaged cache is rebuilt (one info line says so).

    Args:
        data_path: a text file or a directory of text files; None for the standard library.
        vocab_size: size of the byte-level BPE vocabulary to train (>= 257: 256 bytes and end-of-text).
        seq_len: tokens per training sequence (>= 1).
        batch_size: sequences per batch (>= 1).
        val_fraction: share of files (or, for a single file, of its text) held out, in (0, 0.5].
        max_files: use only the first this many files of the seeded shuffle (None: all).
        num_workers: DataLoader workers (>= 0).
        cache_dir: where tokenizers and token ids are cached (None: the user cache directory).
        seed: seed of the train/validation split.
        noise_fraction: share of the *training* tokens replaced by uniformly random tokens, in spans
            of ``noise_span`` (unlearnable tokens, as real web data has); validation stays clean.
        noise_span: length of each noisy span (>= 1; with noise, at most the training tokens).

    Raises:
        ValueError: naming the argument when a setting is out of range (``noise_span`` longer than
            the training tokens: at ``setup``).
    """

    def __init__(
        self,
        data_path: str | None = None,
        vocab_size: int = 8192,
        seq_len: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        max_files: int | None = None,
        num_workers: int = 0,
        cache_dir: str | None = None,
        seed: int = 0,
        noise_fraction: float = 0.0,
        noise_span: int = 16,
    ) -> None:
        super().__init__()
        require_int("vocab_size", vocab_size, 257)
        require_int("seq_len", seq_len, 1)
        require_int("batch_size", batch_size, 1)
        require(0.0 < val_fraction <= 0.5, "val_fraction", val_fraction, "a fraction in (0, 0.5]")
        if max_files is not None:
            require_int("max_files", max_files, 1)
        require_int("num_workers", num_workers, 0)
        require(0.0 <= noise_fraction < 1.0, "noise_fraction", noise_fraction, "a fraction in [0, 1)")
        require_int("noise_span", noise_span, 1)
        self.noise_fraction = noise_fraction
        self.noise_span = noise_span
        self.data_path = data_path
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_files = max_files
        self.num_workers = num_workers
        self.cache_root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.seed = seed
        self.loaded_from_cache: bool | None = None
        self._corpus_files: list[Path] | None = None
        self.train_dataset: TokenWindows | None = None
        self.val_dataset: TokenWindows | None = None

    def _files(self) -> list[Path]:
        if self._corpus_files is None:  # listed once: a skipped file is reported once
            self._corpus_files = corpus_files(self.data_path)
        files = self._corpus_files
        if self.max_files is not None and len(files) > self.max_files:
            shuffled = list(files)
            random.Random(self.seed).shuffle(shuffled)
            files = sorted(shuffled[: self.max_files])
        return files

    @property
    def cache_path(self) -> Path:
        """The cache directory of this corpus and vocabulary."""
        files = self._files()
        version = f"py{sys.version_info.major}{sys.version_info.minor}"
        key = _fingerprint(files, self.vocab_size, self.val_fraction, self.seed, self.max_files)
        return self.cache_root / f"{version}-v{self.vocab_size}-{key}"

    def _texts(self, files: list[Path]) -> tuple[list[str], list[str]]:
        if len(files) == 1:
            text = _read(files[0])
            cut = int(len(text) * (1.0 - self.val_fraction))
            return [text[:cut]], [text[cut:]]
        train_files, val_files = split_files(files, self.val_fraction, self.seed)
        return [_read(p) for p in train_files], [_read(p) for p in val_files]

    def _build(self, target: Path) -> None:
        from tokenizers import ByteLevelBPETokenizer

        train_texts, val_texts = self._texts(self._files())
        rank_zero_info(
            f"training a byte-level BPE (vocab {self.vocab_size}) on {len(train_texts)} files, "
            f"{sum(map(len, train_texts)) / 1e6:.1f} M characters; cached at {target}"
        )
        tokenizer = ByteLevelBPETokenizer()
        tokenizer.train_from_iterator(
            train_texts, vocab_size=self.vocab_size, min_frequency=2, special_tokens=[END_OF_TEXT], show_progress=False
        )
        eot = tokenizer.token_to_id(END_OF_TEXT)
        dtype = np.uint16 if self.vocab_size <= 65536 else np.int32
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".building-"))
        try:
            for name, texts in (("train", train_texts), ("val", val_texts)):
                streams = [enc.ids + [eot] for enc in tokenizer.encode_batch(texts)]
                ids = np.fromiter((i for s in streams for i in s), dtype=dtype)
                np.save(staging / f"{name}.npy", ids)
            tokenizer.save(str(staging / "tokenizer.json"))
            meta = {
                "vocab_size": tokenizer.get_vocab_size(),
                "end_of_text": eot,
                "files": len(train_texts),
                "sha256": {name: _sha256(staging / name) for name in _CACHE_FILES},
            }
            (staging / "meta.json").write_text(json.dumps(meta))
            try:
                os.replace(staging, target)
            except OSError:  # another process finished first: its cache is as good as ours
                shutil.rmtree(staging, ignore_errors=True)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def prepare_data(self) -> None:
        """Train the tokenizer and tokenize the corpus unless the cache already holds them intact.

        A damaged cache (a file missing, unreadable or not matching its recorded checksum) is
        removed and rebuilt, with one info line saying why.
        """
        target = self.cache_path
        problem = cache_problem(target)
        self.loaded_from_cache = problem is None
        if problem is None:
            return
        if target.exists():
            rank_zero_info(f"the token cache at {target} is damaged ({problem}): rebuilding it")
            discarded = target.with_name(f".discarded-{target.name}-{os.getpid()}")
            try:
                os.replace(target, discarded)
            except FileNotFoundError:  # another process removed it first
                pass
            shutil.rmtree(discarded, ignore_errors=True)
        self._build(target)

    def setup(self, stage: str | None = None) -> None:
        """Load the cached token ids into training and held-out datasets (building or repairing the
        cache first when needed); the held-out split serves validation, test and predict.

        Raises:
            ValueError: when the corpus gives fewer training sequences than one batch, or no
                validation sequence, with the counts; when ``noise_span`` is longer than the
                training tokens.
        """
        target = self.cache_path
        if cache_problem(target) is not None:
            self.prepare_data()
        meta = json.loads((target / "meta.json").read_text())
        pad = meta["end_of_text"]
        train_ids = TokenFile(target / "train.npy")
        if self.noise_fraction > 0:
            train_ids = add_span_noise(np.asarray(train_ids), self.noise_fraction, self.noise_span, meta["vocab_size"], self.seed)
        self.train_dataset = TokenWindows(train_ids, self.seq_len, pad)
        self.val_dataset = TokenWindows(TokenFile(target / "val.npy"), self.seq_len, pad)
        source = self.data_path or "the standard library"
        if len(self.train_dataset) < self.batch_size:
            raise ValueError(
                f"the corpus at {source} gives {len(self.train_dataset)} training sequences of seq_len="
                f"{self.seq_len} ({len(self.train_dataset.ids)} tokens), fewer than one batch of "
                f"batch_size={self.batch_size}"
            )
        if len(self.val_dataset) < 1:
            raise ValueError(
                f"the corpus at {source} leaves no validation sequence ({len(self.val_dataset.ids)} tokens "
                f"held out with val_fraction={self.val_fraction}); give more text or a larger val_fraction"
            )

    def tokenizer(self):
        """The trained ``tokenizers.Tokenizer`` (after ``prepare_data``)."""
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.cache_path / "tokenizer.json"))

    def train_dataloader(self) -> DataLoader:
        """Training batches of full size, shuffled per epoch from ``seed``; resumable mid-epoch."""
        return ResumableDataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=EpochShuffleSampler(len(self.train_dataset), seed=self.seed),
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        """Validation batches in order."""
        return DataLoader(self.val_dataset, batch_size=self.batch_size, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        """Test batches in order: the held-out split (the demo has no third split, so it is the
        validation data; evaluate a trained checkpoint with ``lightning-efficient test --ckpt_path``)."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """Prediction batches in order: the held-out split, as for test."""
        return self.val_dataloader()
