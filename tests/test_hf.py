"""``HFCausalLM``'s labels: next tokens already aligned, its loss then Hugging Face's own ``.loss`` of the unshifted
batch; Hugging Face's own convention (labels = input_ids) is refused, not trained as a copy objective."""

import pytest
import torch

from lightning_efficient.hf import HFCausalLM


def _tiny_llama() -> HFCausalLM:
    config = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32}
    torch.manual_seed(0)
    return HFCausalLM(model_type="llama", config=config).double()


def _mean(output) -> torch.Tensor:
    losses, mask = output.token_losses(), output.mask
    return (losses * mask).sum() / mask.sum()


def test_aligned_labels_give_hugging_faces_own_loss_of_the_unshifted_batch():
    model = _tiny_llama()
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    labels = ids[:, 1:].clone()
    labels[0, 7:] = -100  # a padded row
    hf_labels = ids.clone()
    hf_labels[0, 8:] = -100
    ours = _mean(model.token_losses({"input_ids": ids[:, :-1], "labels": labels}))
    theirs = model.model(input_ids=ids, labels=hf_labels).loss
    # (Hugging Face's loss of the full rows, in float32 as its loss function casts the logits; ours sees the rows
    # without their last token, which has no label)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)


@pytest.mark.parametrize("padded", [False, True])
def test_hugging_faces_convention_labels_equal_to_input_ids_is_refused(padded):
    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    if padded:
        labels[1, 6:] = -100
    with pytest.raises(ValueError, match=r"HFCausalLM: labels equal input_ids wherever they count: .* Give "
                                         r"\{\"input_ids\": ids\[:, :-1\], \"labels\": ids\[:, 1:\]\}"):
        model.training_step({"input_ids": ids, "labels": labels}, 0)


def test_aligned_labels_that_also_equal_the_inputs_are_not_refused_and_only_a_fits_first_batch_is_checked():
    model = _tiny_llama()
    constant = torch.full((2, 10), 7)  # a row of one repeated token: its labels are its inputs and its next tokens
    model.training_step({"input_ids": constant, "labels": constant.clone()}, 0)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    one = torch.full_like(ids, -100)
    one[0, 4] = ids[0, 4]  # one counted label equal to its input: no evidence of a copy
    model.on_fit_start()
    model.training_step({"input_ids": ids, "labels": one}, 0)
    model.training_step({"input_ids": ids, "labels": ids.clone()}, 1)  # checked already, at this fit's first batch
    model.on_fit_start()
    with pytest.raises(ValueError, match="HFCausalLM: labels equal input_ids"):
        model.training_step({"input_ids": ids, "labels": ids.clone()}, 0)
