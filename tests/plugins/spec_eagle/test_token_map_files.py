"""--eagle.token-map files that are not token ids: a text file and a tensor of floats are refused in
one line naming the flag and the file (issue 42)."""

from __future__ import annotations

import pytest
import torch

from backplane.plugins.spec_eagle.head import load_token_map


def test_a_text_file_is_one_line(tmp_path):
    path = tmp_path / "map.txt"
    path.write_text("1 2 3\n4 5 6\n")
    with pytest.raises(ValueError) as info:
        load_token_map(str(path), vocab_size=100)
    message = str(info.value)
    assert message.startswith(f"--eagle.token-map {str(path)!r}: expected a tensor or list of token ids")
    assert "\n" not in message


@pytest.mark.parametrize("values", [torch.tensor([1.0, 2.5]), torch.tensor([True, False])])
def test_a_tensor_that_is_not_integers_is_refused(tmp_path, values):
    path = tmp_path / "map.pt"
    torch.save(values, path)
    with pytest.raises(ValueError, match=rf"expected integer token ids, got {values.dtype}"):
        load_token_map(str(path), vocab_size=100)


def test_integer_ids_load_sorted_and_unique(tmp_path):
    path = tmp_path / "map.pt"
    torch.save(torch.tensor([7, 3, 7, 1], dtype=torch.int32), path)
    assert load_token_map(str(path), vocab_size=100).tolist() == [1, 3, 7]
