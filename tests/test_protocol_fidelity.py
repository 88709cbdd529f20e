"""The paper scale runs the paper's protocol (issue 32): every paper-scale cell of every row, composed as train.py /
evaluate.py would, against the protocol transcribed next to the paper's numbers (results/paper/<row>.yaml
``protocol:``). A difference passes only when the row declares it under ``departures:`` (flatbnn/reproduce/protocol.py).
"""

import copy

import pytest

from flatbnn.reproduce import protocol as P
from flatbnn.reproduce.spec import load_row

ROWS = P.rows_with_paper_scale()


@pytest.mark.parametrize("name", ROWS)
def test_paper_scale_follows_the_papers_protocol(name):
    row = load_row(name)
    assert P.protocol_of(row), f"{name}: no protocol in results/paper/{name}.yaml: transcribe the paper's before " \
                               f"its paper scale can run"
    fid = P.check_row(row)
    assert fid.checked > 0 and fid.cells == len([c for c in row.cells_for("paper") if not c.blocked])
    assert not fid.problems, "\n".join(fid.problems)


def _bsam_t6():
    row = load_row("bsam_t6")
    return row, copy.deepcopy(P.protocol_of(row))


def test_an_undeclared_difference_fails_naming_row_cell_key_paper_and_ours():
    row, proto = _bsam_t6()
    proto["entries"]["epochs"]["value"] = 100  # the paper "says" 100; the spec trains 120
    problems = P.check_row(row, proto).problems
    line = next(p for p in problems if "trainer.epochs" in p)
    assert line.startswith("bsam_t6 / fashion_mnist/lenet5/sgd") and "paper 100 (epochs), ours 120" in line
    assert "mnist/mlp/" not in line  # the MNIST cells' own (lost) entry overrides the shared one


def test_a_declared_departure_passes_only_with_the_same_values():
    row, proto = _bsam_t6()
    proto["entries"]["epochs"]["value"] = 100
    dep = {"key": "trainer.epochs", "cells": "fashion_mnist/*", "ours": 120, "paper": 100,
           "category": "our extension", "reason": "test"}
    row.departures = [dep]
    assert not [p for p in P.check_row(row, proto).problems if "trainer.epochs" in p]
    row.departures = [{**dep, "ours": 110}]  # a departure saying 110 does not cover a spec that trains 120
    problems = P.check_row(row, proto).problems
    assert any("undeclared departure" in p and "trainer.epochs" in p for p in problems)
    assert any("matches no difference: remove it" in p for p in problems)  # and the stale one is named
    row.departures = [{**dep, "category": "because"}]
    assert any("category must be one of" in p for p in P.check_row(row, proto).problems)


def test_bsams_small_data_input_scaling_and_warm_up_are_declared_and_go_red_when_the_spec_changes():
    """Issue 52 item 6: the official bSAM code feeds MNIST / FashionMNIST pixels in [0, 1] and warms up 5 epochs on
    every data set; our paper scale standardises and has no warm-up (the finished cells trained so), declared as
    departures. A spec switched to the code's input or warm-up leaves its departure stale, and a departure dropped
    leaves the difference undeclared: both fail. (Two cells, to compose little.)"""
    def problems(row, proto):
        return [p for p in P.check_row(row, proto).problems if "normalize" in p or "warmup" in p]

    for name in ("bsam_t6", "bsam_t3"):
        row = load_row(name)
        proto = copy.deepcopy(P.protocol_of(row))
        for cid in ("mnist/mlp/bsam", "fashion_mnist/lenet5/bsam"):
            entries = P.entries_for(proto, cid)
            assert entries["input scaling"]["value"] is False and entries["warm-up"]["value"] == 5, (name, cid)
        row.cells = ["mnist/mlp/bsam", "fashion_mnist/lenet5/bsam"]
        assert problems(row, proto) == [], name
        paper = row.scales["paper"]
        for switched, key in (("dataset.normalize=false", "dataset.normalize"),
                              ("scheduler.warmup_epochs=5", "scheduler.warmup_epochs")):
            paper["overrides"] = [*paper["overrides"], switched]  # the spec now feeds / warms up as the code does
            found = problems(row, proto)
            assert any(f"departure {key}" in p and "matches no difference: remove it" in p for p in found), found
            paper["overrides"] = paper["overrides"][:-1]
            kept = row.departures
            row.departures = [d for d in kept if d["key"] != key]  # the difference stays, its declaration goes
            found = problems(row, proto)
            assert any(key in p and "an undeclared departure" in p for p in found), found
            row.departures = kept


def test_an_entry_whose_key_the_composed_config_lacks_fails():
    row, proto = _bsam_t6()
    proto["entries"]["epochs"]["key"] = "trainer.epoch"
    problems = P.check_row(row, proto).problems
    assert any("maps to trainer.epoch, which the composed config does not have" in p for p in problems)


def test_entries_need_a_source_or_a_status_and_cell_patterns_must_match():
    row, proto = _bsam_t6()
    del proto["entries"]["epochs"]["source"]
    assert any("needs `value:` and `source:`" in p for p in P.check_row(row, proto).problems)
    row, proto = _bsam_t6()
    proto["entries"]["batch size"].pop("from")
    assert any("needs `from:`" in p for p in P.check_row(row, proto).problems)
    row = load_row("hwa_fig1")
    proto = copy.deepcopy(P.protocol_of(row))
    proto["cells"]["cifar100/*"] = {}
    assert any("'cifar100/*' matches no paper-scale cell" in p for p in P.check_row(row, proto).problems)


def test_values_compare_as_protocol_values():
    assert P.same(4.1667e-4, 25 / 60000, rel_tol=1e-4) and not P.same(4.1667e-4, 25 / 60000)
    assert not P.same(True, 1) and not P.same(0.2828, 0.565685424949238)
    assert P.same([0.9, 0.999], [0.9, 0.999]) and not P.same([0.9], [0.9, 0.999])


def test_an_inheriting_protocol_adds_to_the_same_glob_and_a_repeated_key_is_caught():
    row = load_row("bsam_t5")  # inherits bsam_t1; both write "cifar100/*"
    entries = P.entries_for(P.protocol_of(row), "cifar100/resnet20_frn/bsam/m2")
    assert entries["outputs"]["value"] == 99 and entries["batch size"]["value"] == 200  # bsam_t1's and its own
    assert entries["m"]["value"] == 2 and entries["lr"]["key"] == "method.lr"
    assert P.duplicate_keys("a:\n  x: 1\n  y: 2\n  x: 3\nb: [{z: 1, z: 2}]\n") == ["x", "z"]
    assert P.duplicate_keys("a: &v {x: 1}\nb: {<<: *v, y: 2}\n") == []


def test_status_board_and_comparison_page_show_fidelity_and_departures(monkeypatch):
    import re

    from flatbnn.reproduce import compare, compare_markdown, status
    line = next(x for x in status.render().splitlines() if x.startswith("| `bsam_t6`"))
    assert re.search(r"\| \d+ checked / 9 departures \|", line)
    monkeypatch.setattr(P, "protocol_of", lambda row: None)  # a row nobody transcribed says so, never passes quietly
    line = next(x for x in status.render().splitlines() if x.startswith("| `hwa_fig1`"))
    assert "**no protocol yet**" in line
    monkeypatch.undo()
    md = "\n".join(compare_markdown._fidelity_markdown({"row": "bsam_t6", "fidelity": compare._fidelity(load_row("bsam_t6"))}))
    assert "## Departures from the paper's protocol" in md
    assert "| `model.num_classes` | `mnist/*` | 10 | 9 | official code differs: K softmax logits" in md
    assert "| `dataset.normalize` | `*` | True | False | paper silent: The paper does not say" in md
