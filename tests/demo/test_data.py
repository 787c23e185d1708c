from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_efficient import CorpusDataModule
from lightning_efficient.demo.data import TokenFile, TokenWindows, split_files


def test_second_build_reads_the_cache_and_ids_are_deterministic(small_corpus, tmp_path):
    kwargs = {"data_path": str(small_corpus), "vocab_size": 400, "seq_len": 16, "batch_size": 2}
    first = CorpusDataModule(**kwargs, cache_dir=str(tmp_path / "a"))
    first.prepare_data()
    assert first.loaded_from_cache is False
    first.setup("fit")
    again = CorpusDataModule(**kwargs, cache_dir=str(tmp_path / "a"))
    again.prepare_data()
    assert again.loaded_from_cache is True
    again.setup("fit")
    assert np.array_equal(first.train_dataset.ids, again.train_dataset.ids)
    independent = CorpusDataModule(**kwargs, cache_dir=str(tmp_path / "b"))
    independent.prepare_data()
    independent.setup("fit")
    assert independent.loaded_from_cache is False
    assert np.array_equal(first.train_dataset.ids, independent.train_dataset.ids)
    assert np.array_equal(first.val_dataset.ids, independent.val_dataset.ids)
    assert int(np.asarray(first.train_dataset.ids).max()) < 400
    encoded = first.tokenizer().encode("def f(x):\n    return x\n").ids
    assert encoded == independent.tokenizer().encode("def f(x):\n    return x\n").ids


def test_cache_is_keyed_by_vocabulary(small_corpus, tmp_path):
    a = CorpusDataModule(data_path=str(small_corpus), vocab_size=400, cache_dir=str(tmp_path))
    b = CorpusDataModule(data_path=str(small_corpus), vocab_size=500, cache_dir=str(tmp_path))
    assert a.cache_path != b.cache_path
    assert "v400" in a.cache_path.name and "py3" in a.cache_path.name


def test_split_is_by_file_deterministic_and_disjoint(small_corpus):
    files = sorted(small_corpus.iterdir())
    train, val = split_files(files, 0.1, seed=0)
    assert split_files(files, 0.1, seed=0) == (train, val)
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(files)
    assert len(val) == 4


def test_windows_pad_the_last_sequence_with_ignored_labels():
    ids = np.arange(10, dtype=np.uint16)
    windows = TokenWindows(ids, seq_len=4, pad_id=0)
    assert len(windows) == 3
    first = windows[0]
    assert first["input_ids"].tolist() == [0, 1, 2, 3] and first["labels"].tolist() == [1, 2, 3, 4]
    last = windows[2]
    assert last["input_ids"].tolist() == [8, 0, 0, 0]
    assert last["labels"].tolist() == [9, -100, -100, -100]
    assert torch.cat([windows[i]["labels"] for i in range(3)])[:9].tolist() == list(range(1, 10))


def test_missing_data_path_names_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        CorpusDataModule(data_path=str(missing), cache_dir=str(tmp_path)).setup("fit")


def test_corpus_too_small_for_a_batch_gives_the_counts(tmp_path):
    (tmp_path / "a.txt").write_text("x = 1\n" * 50)
    (tmp_path / "b.txt").write_text("y = 2\n" * 50)
    data = CorpusDataModule(data_path=str(tmp_path), vocab_size=300, seq_len=64, batch_size=64, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"gives \d+ training sequences of seq_len=64 .* batch_size=64"):
        data.setup("fit")


@pytest.mark.parametrize(("name", "value"), [("vocab_size", 100), ("seq_len", 0), ("val_fraction", 0.0), ("batch_size", 0)])
def test_invalid_data_settings(name, value):
    with pytest.raises(ValueError, match=rf"^{name}="):
        CorpusDataModule(**{name: value})


def test_span_noise_replaces_about_the_fraction_in_whole_spans():
    from lightning_efficient.demo.data import add_span_noise

    ids = np.zeros(16000, dtype=np.uint16)
    noisy = add_span_noise(ids, 0.25, 16, vocab_size=1000, seed=0)
    assert np.array_equal(noisy, add_span_noise(ids, 0.25, 16, vocab_size=1000, seed=0))
    changed_spans = (noisy.reshape(-1, 16) != 0).any(axis=1)
    assert 0.2 < changed_spans.mean() < 0.3
    assert int(noisy.max()) < 1000 and ids.max() == 0  # the input is not modified


def _tiny_texts(root):
    """Three small text files (a few hundred tokens each): a tokenizer trains on them in a moment."""
    root.mkdir()
    for i, name in enumerate(("a.txt", "b.txt", "c.txt")):
        (root / name).write_text("".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(60)))
    return root


@pytest.mark.parametrize("damaged", ["train.npy", "tokenizer.json", "meta.json"])
def test_a_damaged_cache_is_detected_and_rebuilt(tmp_path, lightning_caplog, damaged):
    caplog = lightning_caplog
    kwargs = {"data_path": str(_tiny_texts(tmp_path / "texts")), "vocab_size": 300, "seq_len": 16, "batch_size": 2,
              "cache_dir": str(tmp_path / "cache")}
    first = CorpusDataModule(**kwargs)
    first.setup("fit")
    pristine = np.array(first.train_dataset.ids)
    target = first.cache_path / damaged
    target.write_bytes(target.read_bytes()[: len(target.read_bytes()) // 2])  # a truncated write
    again = CorpusDataModule(**kwargs)
    with caplog.at_level("INFO"):
        again.prepare_data()
    assert again.loaded_from_cache is False
    assert any("damaged" in r.getMessage() and damaged in r.getMessage() for r in caplog.records), caplog.text
    again.setup("fit")
    assert np.array_equal(again.train_dataset.ids, pristine)
    assert again.tokenizer().encode("def f(x):").ids == first.tokenizer().encode("def f(x):").ids
    third = CorpusDataModule(**kwargs)
    third.prepare_data()
    assert third.loaded_from_cache is True


def test_utf16_files_are_read_and_binary_files_reported_in_one_line(tmp_path, lightning_caplog):
    caplog = lightning_caplog
    from lightning_efficient.demo.data import corpus_files

    root = tmp_path / "texts"
    root.mkdir()
    text = "zebra_marker = 'wide text'\n" * 200
    (root / "plain.txt").write_text(text, encoding="utf-8")
    (root / "wide.txt").write_text(text, encoding="utf-16")  # with a byte-order mark
    (root / "wide32.txt").write_text(text, encoding="utf-32")
    (root / "image.bin").write_bytes(bytes(range(256)) * 8)
    with caplog.at_level("INFO"):
        files = corpus_files(str(root))
    assert [p.name for p in files] == ["plain.txt", "wide.txt", "wide32.txt"]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "1 binary file" in skipped[0] and "image.bin" in skipped[0]
    # a UTF-16 file alone is the corpus: its text, not its bytes, is what the tokenizer sees
    data = CorpusDataModule(data_path=str(root / "wide.txt"), vocab_size=300, seq_len=16, batch_size=2,
                            cache_dir=str(tmp_path / "cache"))
    data.setup("fit")
    decoded = data.tokenizer().decode([int(i) for i in data.train_dataset.ids[:200]])
    assert "zebra_marker = 'wide text'" in decoded


def test_a_noise_span_longer_than_the_corpus_is_refused(tmp_path):
    from lightning_efficient.demo.data import add_span_noise

    with pytest.raises(ValueError, match=r"noise_span=100 is longer than the 50 training tokens"):
        add_span_noise(np.zeros(50, dtype=np.uint16), 0.5, 100, vocab_size=300, seed=0)
    assert np.array_equal(add_span_noise(np.zeros(50, dtype=np.uint16), 0.0, 100, vocab_size=300, seed=0), np.zeros(50))
    data = CorpusDataModule(data_path=str(_tiny_texts(tmp_path / "texts")), vocab_size=300, seq_len=16, batch_size=2,
                            cache_dir=str(tmp_path / "cache"), noise_fraction=0.2, noise_span=10**6)
    with pytest.raises(ValueError, match=r"noise_span=1000000 is longer than the \d+ training tokens"):
        data.setup("fit")


def _file_rss_bytes() -> int:
    """Resident file-backed pages of this process (/proc/self/status RssFile)."""
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_reading_the_training_windows_at_random_leaves_the_corpus_file_out_of_the_process_rss(tmp_path):
    # a memory map of the token file grows the RSS by the kernel's fault-around (64 KiB) per window drawn at random,
    # to the whole file: on CPU that counts as training memory
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("".join(f"def f_{j}(x):\n    return x * {j} + {j % 7}\n\n" for j in range(30000)))
    data = CorpusDataModule(data_path=str(texts), vocab_size=300, seq_len=16, batch_size=2, val_fraction=0.5,
                            cache_dir=str(tmp_path / "cache"))
    data.setup("fit")
    dataset = data.train_dataset
    size = (data.cache_path / "train.npy").stat().st_size
    assert size > 256 * 1024  # several fault-around windows
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
    dataset[order[0]]  # the code reading a window is paged in
    before = _file_rss_bytes()
    windows = [dataset[i] for i in order]
    assert _file_rss_bytes() - before < 64 * 1024
    assert torch.cat([w["labels"] for w in windows]).numel() == len(order) * 16


def test_a_token_file_reads_what_the_array_holds_and_travels_to_another_process(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) * 7
    np.save(tmp_path / "ids.npy", ids)
    tokens = TokenFile(tmp_path / "ids.npy")
    assert len(tokens) == 1000
    assert np.array_equal(tokens[10:20], ids[10:20]) and np.array_equal(tokens[995:1010], ids[995:])
    assert np.array_equal(np.asarray(tokens), ids)
    windows = TokenWindows(tokens, seq_len=8, pad_id=0)
    tokens[0:1]  # this process's file is open before the workers fork: each opens its own
    for start in ("fork", "spawn"):
        loader = torch.utils.data.DataLoader(windows, batch_size=4, num_workers=2, multiprocessing_context=start)
        labels = torch.cat([b["labels"].flatten() for b in loader])
        assert labels[:999].tolist() == ids[1:].astype(np.int64).tolist()
    assert np.array_equal(tokens[5:3], ids[5:3]) and tokens[5:3].dtype == ids.dtype
    with pytest.raises(ValueError, match="copy"):
        np.asarray(tokens, copy=False)
    with pytest.raises(ValueError, match="index"):
        tokens[::2]
    with pytest.raises(ValueError, match="path"):
        np.save(tmp_path / "grid.npy", np.zeros((2, 2)))
        TokenFile(tmp_path / "grid.npy")
