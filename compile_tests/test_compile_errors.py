"""A bad input under torch.compile: the user sees cakeops' own message, in their terms.

With ``fullgraph=False`` Dynamo breaks the graph at the raise and re-runs the frame eagerly, so the plain
ValueError arrives. With ``fullgraph=True`` (torch 2.11 to 2.14) Dynamo reports every exception raised while
tracing as ``torch._dynamo.exc.Unsupported: Observed exception``; its text still carries the original message
("Developer debug context: raised exception ValueError('...')"), which these tests pin so that it never gets
lost. The checks run in Python before any op, so the message is the eager one, word for word.
"""
import pytest
import torch

import cakeops
from cakeops.cake_mhc_train import cake_mhc_train_finish, cake_mhc_train_prepare

N, C = 4, 8


def _bad_scale(X, scale):
    fn, base = torch.zeros(24, N * C), torch.zeros(24)
    U, handle = cake_mhc_train_prepare(X, fn, scale, base)
    return cake_mhc_train_finish(X, U, handle)


CASES = [
    ("functional scale [4]", lambda: (_bad_scale, (torch.randn(3, N, C), torch.ones(4))),
     "scale: expected shape (3,), got (4,): one scale per group of logits (pre, post, res)"),
    ("nn.MHC branch of the wrong width", lambda: (cakeops.nn.MHC(torch.nn.Linear(C, C // 2), hidden_size=C),
                                                  (torch.randn(2, 3, N, C),)),
     "MHC: the branch must map [..., 8] to [..., 8]: given (2, 3, 8), it returned (2, 3, 4)"),
    ("nn.MHC given [8, 64]", lambda: (cakeops.nn.MHC(torch.nn.Identity(), hidden_size=C), (torch.randn(8, 64),)),
     "MHC: expected the residual streams [..., 4, 8] (n_streams, hidden_size), got (8, 64)"),
    ("nn.RMSNorm of another width", lambda: (cakeops.nn.RMSNorm(16), (torch.randn(3, 8),)),
     "RMSNorm: expected an input [..., 16] (normalized_shape), got (3, 8)"),
]


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph-breaks"])
@pytest.mark.parametrize("case,make,message", CASES, ids=[c[0] for c in CASES])
def test_the_users_message_survives_torch_compile(case, make, message, fullgraph):
    fn, inputs = make()
    with pytest.raises(ValueError, match=r"^" + __import__("re").escape(message)):
        fn(*inputs)  # eager: the message itself
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager", fullgraph=fullgraph)
    with pytest.raises(Exception) as info:
        compiled(*inputs)
    assert message in str(info.value), str(info.value)
    if not fullgraph:
        assert isinstance(info.value, ValueError)
