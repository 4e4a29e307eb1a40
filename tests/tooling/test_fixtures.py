# SPDX-License-Identifier: Apache-2.0
"""The targets the tooling tests run on share the pristine cache's files by
hard link; what a test writes in place must be a copy of its own, and a write
through a link must show in the cache's signatures."""

from __future__ import annotations

from pathlib import Path

from tests.tooling.conftest import SMALL_TREE, file_signatures, linked_copy


def fake_pristine(root: Path) -> Path:
    for rel in (*SMALL_TREE, "vllm/config/model.py", "vllm-0.33.0.dist-info/RECORD"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"# {rel}\n")
    return root


def test_linked_copy_shares_only_files_no_test_writes_in_place(tmp_path):
    pristine = fake_pristine(tmp_path / "pristine")
    copy = linked_copy(pristine, tmp_path / "copy")

    def same_file(rel: str) -> bool:
        return (copy / rel).samefile(pristine / rel)

    assert same_file("vllm/config/model.py")
    assert not any(same_file(rel) for rel in SMALL_TREE)
    assert not same_file("vllm-0.33.0.dist-info/RECORD")
    assert {p.read_text() for p in copy.rglob("*.py")} == {
        p.read_text() for p in pristine.rglob("*.py")
    }


def test_a_write_through_a_link_changes_the_cache_signatures(tmp_path):
    pristine = fake_pristine(tmp_path / "pristine")
    copy = linked_copy(pristine, tmp_path / "copy")
    before = file_signatures(pristine)
    with open(copy / "vllm/logger.py", "a") as f:  # a copied file: no change
        f.write("# edited\n")
    assert file_signatures(pristine) == before
    with open(copy / "vllm/config/model.py", "a") as f:  # a linked one
        f.write("# edited\n")
    after = file_signatures(pristine)
    assert {rel for rel in before if before[rel] != after[rel]} == {
        "vllm/config/model.py"
    }
