"""PrefixTree: rows merged where they share a prefix, hand-computed."""

import torch

from algorithms.prefix_tree import PrefixTree

# three right-padded rows (pad 0): prompt 5 6, then policy (mask 1) and env (mask 0) tokens
IDS = torch.tensor(
    [
        [5, 6, 7, 8, 9],  # 5 6 | 7 8 policy | 9 env
        [5, 6, 7, 4, 0],  # 5 6 | 7 4 policy | pad: shares 5 6 7 with row 0
        [5, 6, 7, 8, 9],  # as row 0, but its 9 is a policy token
    ]
)
ATTN = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
ACTION = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])


def test_rows_share_their_common_prefix_and_split_where_they_differ():
    tree = PrefixTree.from_rows(IDS, ATTN, ACTION)
    # nodes: 0:5 1:6 2:7 3:8 4:9(env) | 5:4 | 6:9(policy: another node than row 0's env 9)
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9, 4, 9]
    assert tree.positions.tolist() == [0, 1, 2, 3, 4, 3, 4]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 2, 3]
    assert tree.scored.tolist() == [False, False, True, True, False, True, True]
    assert tree.node_of.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 5, -1], [0, 1, 2, 3, 6]]
    assert len(tree) == 7 and tree.width == 7
    assert tree.trees.tolist() == [0] * 7 and tree.columns.tolist() == list(range(7))


def test_each_node_attends_to_itself_and_its_ancestors():
    inputs = PrefixTree.from_rows(IDS, ATTN, ACTION).model_inputs()
    assert inputs["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4, 9]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 4]]
    mask = inputs["attention_mask"]
    assert mask.shape == (1, 1, 7, 7) and mask.dtype == torch.bool
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for node, ancestors in {
        0: [0],
        1: [0, 1],
        2: [0, 1, 2],
        3: [0, 1, 2, 3],
        4: [0, 1, 2, 3, 4],
        5: [0, 1, 2, 5],  # row 1's 4 does not see row 0's 8
        6: [0, 1, 2, 3, 6],  # row 2's 9 does not see row 0's 9
    }.items():
        expected[node, ancestors] = True
    assert torch.equal(mask[0, 0], expected)


def test_without_an_action_mask_every_token_but_the_first_is_scored():
    tree = PrefixTree.from_rows(IDS, ATTN)
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9, 4]  # the two 9s are one node now
    assert tree.scored.tolist() == [False, True, True, True, True, True]
    assert tree.node_of[2].tolist() == [0, 1, 2, 3, 4]


def test_rows_with_different_first_tokens_make_separate_trees_in_a_batch():
    ids = torch.tensor([[1, 2, 0], [3, 2, 4], [1, 5, 0]])
    attn = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0]])
    tree = PrefixTree.from_rows(ids, attn)
    # nodes: 0:1 1:2 (tree 0) | 2:3 3:2 4:4 (tree 1) | 5:5 (tree 0, after 1)
    assert tree.parents.tolist() == [-1, 0, -1, 2, 3, 0]
    assert tree.trees.tolist() == [0, 0, 1, 1, 1, 0]
    assert tree.columns.tolist() == [0, 1, 0, 1, 2, 2]
    assert tree.width == 3
    assert tree.flat_index(torch.tensor([5, 4])).tolist() == [0 * 3 + 2, 1 * 3 + 2]
    inputs = tree.model_inputs()
    assert inputs["input_ids"].tolist() == [[1, 2, 5], [3, 2, 4]]
    assert inputs["position_ids"].tolist() == [[0, 1, 1], [0, 1, 2]]
    mask = inputs["attention_mask"][:, 0].int().tolist()
    assert mask[0] == [[1, 0, 0], [1, 1, 0], [1, 0, 1]]  # 5 sees 1, not 2
    assert mask[1] == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_a_shorter_tree_is_padded_with_nodes_that_see_only_themselves():
    ids = torch.tensor([[1, 2, 3], [4, 0, 0]])
    attn = torch.tensor([[1, 1, 1], [1, 0, 0]])
    inputs = PrefixTree.from_rows(ids, attn).model_inputs()
    assert inputs["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert inputs["attention_mask"][1, 0].int().tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
