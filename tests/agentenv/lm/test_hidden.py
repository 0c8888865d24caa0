import torch

from agentenv.lm.hidden import recording_head_input


def test_the_head_input_is_recorded_as_a_copy_of_each_rows_last_state(tiny_model):
    """What the LM head read at each row's last position, in float32, and a copy: the
    head's input is a view of the forward's whole last hidden states (``(n, T, H)``),
    which an episode must not keep alive."""
    ids = torch.randint(100, 1000, (2, 10))
    with torch.no_grad():
        full = tiny_model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        with recording_head_input(tiny_model) as seen:
            logits = tiny_model(input_ids=ids, logits_to_keep=1).logits
    assert len(seen) == 1 and seen[0].shape == (2, full.shape[-1])
    assert seen[0].dtype == torch.float32
    torch.testing.assert_close(seen[0], full[:, -1].float())
    head = tiny_model.get_output_embeddings()
    torch.testing.assert_close(head(seen[0]), logits[:, -1])
    assert seen[0].untyped_storage().nbytes() == seen[0].numel() * 4
    with torch.no_grad():
        tiny_model(input_ids=ids, logits_to_keep=1)
    assert len(seen) == 1  # the hook is gone after the block
