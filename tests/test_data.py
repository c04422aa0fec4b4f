"""Tests of the data pipeline: tokenizing text files into the memmap and its index, reading
windows back, the sample schedule, and clear errors for damaged files."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from tahnode.train.corpus import BYTE_VOCAB_SIZE, EOD_TOKEN, DatasetInfo, default_corpus, prepare
from tahnode.train.data import SampleSchedule, TokenDataset

DOCS = {
    "b/second.py": "print('héllo')\n",
    "a.txt": "first document\n",
    "c/deep/third.md": "# third\n\nsome *markdown*\n",
    "notes.rst": "",  # an empty document still gets its end-of-document token
}


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    for name, text in DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0")  # wrong suffix: not looked at
    (root / "binary.txt").write_bytes(b"abc\0def")  # NUL bytes: skipped
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8: skipped
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.py").write_text("cached")  # skipped directory
    return root


def expected_bytes_tokens() -> list[int]:
    """Byte tokens + EOD of the documents, in sorted path order."""
    out = []
    for name in sorted(DOCS, key=lambda n: Path(n).parts):
        out += list(DOCS[name].encode("utf-8")) + [EOD_TOKEN]
    return out


def test_prepare_bytes_writes_exactly_the_bytes_and_eod(corpus, tmp_path):
    out = tmp_path / "data" / "tokens.bin"
    info = prepare([corpus], out, progress=False)
    expected = expected_bytes_tokens()
    tokens = np.fromfile(out, dtype=np.uint16)
    assert tokens.tolist() == expected
    assert info.n_tokens == len(expected) and info.sources == len(DOCS)
    assert info.dtype == "uint16" and info.vocab_size == BYTE_VOCAB_SIZE == 257
    assert info.eod_token == EOD_TOKEN and info.tokenizer == "bytes"
    index = json.loads(out.with_suffix(".json").read_text())
    assert index["n_tokens"] == len(expected) and index["sha256"] == info.sha256
    assert DatasetInfo.read(out.with_suffix(".json")) == info


def test_prepare_is_deterministic(corpus, tmp_path):
    a = prepare([corpus], tmp_path / "a.bin", progress=False)
    b = prepare([corpus / "c", corpus / "a.txt", corpus / "b", corpus / "notes.rst"],
                tmp_path / "b.bin", progress=True)
    assert a.sha256 == b.sha256
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()


def test_prepare_errors(tmp_path, corpus):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no text files"):
        prepare([empty], tmp_path / "x.bin", progress=False)
    assert not (tmp_path / "x.bin").exists()
    with pytest.raises(FileNotFoundError, match="missing"):
        prepare([tmp_path / "missing"], tmp_path / "x.bin", progress=False)
    with pytest.raises(ValueError, match=".json"):
        prepare([corpus], tmp_path / "x.json", progress=False)


def test_token_dataset_windows_and_shifted_labels(corpus, tmp_path):
    out = tmp_path / "tokens.bin"
    prepare([corpus], out, progress=False)
    stream = expected_bytes_tokens()
    seq = 8
    ds = TokenDataset(out, seq_len=seq)
    assert len(ds) == (len(stream) - 1) // seq
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (seq,)
        assert x.tolist() == stream[i * seq:(i + 1) * seq]
        assert y.tolist() == stream[i * seq + 1:(i + 1) * seq + 1]
    tokens, labels = ds.batch([3, 0, 3])
    assert tokens.shape == labels.shape == (3, seq) and tokens.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], labels[:, :-1])
    assert torch.equal(tokens[0], ds[3][0]) and torch.equal(labels[1], ds[0][1])
    with pytest.raises(IndexError):
        ds.batch([len(ds)])
    with pytest.raises(ValueError, match="too few"):
        TokenDataset(out, seq_len=len(stream))


def test_truncated_token_file_is_refused(corpus, tmp_path):
    out = tmp_path / "tokens.bin"
    prepare([corpus], out, progress=False)
    out.write_bytes(out.read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated"):
        TokenDataset(out, seq_len=4)


def test_changed_token_file_fails_hash_check(corpus, tmp_path):
    out = tmp_path / "tokens.bin"
    prepare([corpus], out, progress=False)
    TokenDataset(out, seq_len=4, verify_hash=True)
    data = bytearray(out.read_bytes())
    data[0] ^= 1
    out.write_bytes(bytes(data))
    TokenDataset(out, seq_len=4)  # same size: only the hash check sees it
    with pytest.raises(ValueError, match="sha256"):
        TokenDataset(out, seq_len=4, verify_hash=True)


@pytest.mark.parametrize("damage,match", [
    (lambda idx: "{not json", "not JSON"),
    (lambda idx: json.dumps([1, 2]), "not a JSON object"),
    (lambda idx: json.dumps({k: v for k, v in idx.items() if k != "n_tokens"}), "n_tokens"),
    (lambda idx: json.dumps({**idx, "dtype": "float32"}), "dtype"),
    (lambda idx: json.dumps({**idx, "n_tokens": -5}), "n_tokens"),
    (lambda idx: json.dumps({**idx, "eod_token": 999}), "eod_token"),
])
def test_corrupt_index_is_refused(corpus, tmp_path, damage, match):
    out = tmp_path / "tokens.bin"
    prepare([corpus], out, progress=False)
    index = out.with_suffix(".json")
    index.write_text(damage(json.loads(index.read_text())))
    with pytest.raises(ValueError, match=match):
        TokenDataset(out, seq_len=4)


def test_missing_index_is_refused(corpus, tmp_path):
    out = tmp_path / "tokens.bin"
    prepare([corpus], out, progress=False)
    out.with_suffix(".json").unlink()
    with pytest.raises(FileNotFoundError, match="prepare"):
        TokenDataset(out, seq_len=4)


def test_prepare_with_tokenizer_json(corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS.values(), trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<eos>"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))

    out = tmp_path / "tokens.bin"
    info = prepare([corpus], out, tokenizer=path, progress=False)
    eos = tok.token_to_id("<eos>")
    expected = []
    for name in sorted(DOCS, key=lambda n: Path(n).parts):
        expected += tok.encode(DOCS[name]).ids + [eos]
    assert np.fromfile(out, dtype=np.uint16).tolist() == expected
    assert info.eod_token == eos and info.vocab_size == tok.get_vocab_size()
    assert info.tokenizer == str(path.resolve()) and info.tokenizer_sha256
    ds = TokenDataset(out, seq_len=3)
    assert ds.vocab_size == tok.get_vocab_size()
    assert ds.batch([0])[0][0].tolist() == expected[:3]


def test_tokenizer_without_eod_token_is_refused(corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS.values(), trainers.WordLevelTrainer(special_tokens=["<unk>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="end-of-document"):
        prepare([corpus], tmp_path / "t.bin", tokenizer=tmp_path / "tokenizer.json",
                progress=False)


def test_sample_schedule_is_deterministic_and_covers_each_epoch():
    n, bs, mbs = 50, 3, 4
    a = SampleSchedule(n, bs, mbs, seed=9)
    b = SampleSchedule(n, bs, mbs, seed=9)
    steps = range(25)  # 300 ids = 6 epochs
    ids_a = [i for s in steps for m in range(mbs) for i in a.ids(s, m)]
    ids_b = [i for s in reversed(steps) for m in reversed(range(mbs)) for i in b.ids(s, m)]
    assert ids_a == [i for s in steps for m in range(mbs) for i in b.ids(s, m)]
    assert sorted(ids_a) == sorted(ids_b)
    assert all(len(a.ids(s, m)) == bs for s in steps for m in range(mbs))
    epochs = [ids_a[e * n:(e + 1) * n] for e in range(len(ids_a) // n)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(n))  # each id once per epoch
    assert epochs[0] != epochs[1]  # a fresh permutation per epoch
    assert epochs[0] != list(range(n))  # shuffled
    other = [i for s in steps for m in range(mbs) for i in SampleSchedule(n, bs, mbs, 10).ids(s, m)]
    assert other != ids_a
    plain = SampleSchedule(n, bs, mbs, shuffle=False)
    assert plain.ids(0, 1) == [3, 4, 5] and plain.ids(4, 0) == [48, 49, 0]
    assert a.epoch(25) == 6.0


def test_pipelines_train_samples_of_their_own():
    """Each pipeline owns a lane of the stream as long as a whole run: no two (step, pipeline) of a run
    share a sample while the run's samples fit one epoch; pipeline 0 is the single stream."""
    n, bs, mbs, slots, steps = 1000, 3, 2, 4, 40
    schedule = SampleSchedule(n, bs, mbs, seed=5, slots=slots, lane=steps * bs * mbs)
    single = SampleSchedule(n, bs, mbs, seed=5)
    seen = [i for p in range(slots) for step in range(steps) for m in range(mbs) for i in schedule.ids(step, m, p)]
    assert len(seen) == len(set(seen)) == slots * steps * bs * mbs  # 960 of 1000: within one epoch, none twice
    assert ([schedule.ids(s, m) for s in range(steps) for m in range(mbs)]
            == [single.ids(s, m) for s in range(steps) for m in range(mbs)])
    assert schedule.ids(0, 0, 1) == single.ids_at(steps, 0, bs)  # pipeline 1 starts where a run of pipeline 0 ends
    with pytest.raises(ValueError, match="pipeline 4 is out of range"):
        schedule.ids(0, 0, 4)
    with pytest.raises(ValueError, match="lanes"):
        SampleSchedule(n, bs, mbs, slots=2, lane=5)
    assert schedule.epoch(100) == 100 * bs * mbs / n


def test_sample_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="micro_batch"):
        SampleSchedule(10, 2, 2).ids(0, 2)
    with pytest.raises(ValueError, match="step"):
        SampleSchedule(10, 2, 2).ids(-1, 0)
    with pytest.raises(ValueError, match="batch_size"):
        SampleSchedule(3, 4, 1)


def test_default_corpus_finds_stdlib_sources(tmp_path):
    files = default_corpus()
    names = {p.name for p in files}
    assert {"os.py", "__init__.py"} <= names
    assert files == sorted(files)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert not any(part in ("site-packages", "test", "tests")
                   for p in files for part in p.relative_to(stdlib).parts)
    small = default_corpus(limit_bytes=200_000)
    assert 0 < len(small) < len(files) and small == files[:len(small)]
    assert sum(p.stat().st_size for p in small) <= 200_000
    info = prepare(small[:3], tmp_path / "std.bin", progress=False)
    assert info.sources == 3
    assert info.n_tokens == sum(len(p.read_bytes()) + 1 for p in small[:3])


def word_tokenizer(tmp_path: Path, name: str = "tokenizer.json", bos: bool = False) -> Path:
    """A word-level tokenizer.json of the documents; with `bos`, its template starts every document with <s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS.values(), trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "<eos>"]))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", tok.token_to_id("<s>"))])
    path = tmp_path / name
    tok.save(str(path))
    return path


def test_each_document_gets_the_tokenizers_bos_and_one_eod(corpus, tmp_path):
    from tokenizers import Tokenizer

    path = word_tokenizer(tmp_path, bos=True)
    tok = Tokenizer.from_file(str(path))
    out = tmp_path / "tokens.bin"
    prepare([corpus], out, tokenizer=path, progress=False)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("<eos>")
    expected = []
    for name in sorted(DOCS, key=lambda n: Path(n).parts):
        expected += [bos] + tok.encode(DOCS[name], add_special_tokens=False).ids + [eos]
    assert np.fromfile(out, dtype=np.uint16).tolist() == expected


def test_outputs_never_overwrite_inputs(corpus, tmp_path):
    """`--out tokenizer.bin` would write its index over tokenizer.json; `--out` naming an input file
    would overwrite it: both refused, nothing written."""
    path = word_tokenizer(tmp_path)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="would overwrite the input .*tokenizer.json"):
        prepare([corpus], tmp_path / "tokenizer.bin", tokenizer=path, progress=False)
    with pytest.raises(ValueError, match="would overwrite the input .*a.txt"):
        prepare([corpus], corpus / "a.txt", progress=False)
    assert path.read_bytes() == before and (corpus / "a.txt").read_text() == DOCS["a.txt"]
    assert not (tmp_path / "tokenizer.bin").exists()


def test_data_of_a_larger_vocabulary_than_the_model_is_refused(corpus, tmp_path):
    from tahnode.config import RunConfig
    from tahnode.train.data import check_run_data, open_dataset

    out = tmp_path / "tokens.bin"
    prepare([corpus], out, progress=False)  # bytes: a vocabulary of 257
    small = tmp_path / "small.toml"
    small.write_text("[model]\nvocab_size = 200\ndim = 32\nn_layers = 3\nn_heads = 2\nn_kv_heads = 2\nffn_dim = 64\n"
                     "max_seq_len = 64\n")
    run = RunConfig.build(str(small), None, data=str(out))
    for refuse in (lambda: open_dataset(run), lambda: check_run_data(run, here=False)):
        with pytest.raises(ValueError, match="vocabulary of 257 .* the model's vocab_size is 200"):
            refuse()
    with pytest.raises(ValueError, match="built-in corpus"):
        check_run_data(RunConfig.build(str(small), None), here=False)
    # not here: let pass
    check_run_data(RunConfig.build(str(small), None, data=str(tmp_path / "elsewhere.bin")), here=False)
