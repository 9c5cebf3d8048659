"""The parameter-server wire and tables refuse what they cannot act on (issue 25, item 4): a
malformed header is a WireError naming the sender's rank and the field, an id outside a table
is refused on the worker before it leaves (IndexError, as data parallelism's nn.Embedding
raises) and again on the server; and which parameters train row-wise is the model's declaration,
not a guess from shapes, so ddp and ps train the same recsys model at every size. The headers
are fed straight to the code that receives them, with a wire that only records."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from gradmesh.comm.ps_wire import Kind, Message, WireError
from helpers import rel_l2, weights


class RecordingWire:
    """Sends are kept; a payload receive copies the next of `payloads` into its buffer."""

    def __init__(self, payloads=()):
        self.sent, self.payloads = [], list(payloads)

    def send(self, dst, message, payload=None):
        self.sent.append((dst, message))

    def send_payload(self, dst, payload):
        self.sent.append((dst, payload))

    def payload_from(self, source, into):
        into.copy_(self.payloads.pop(0))
        return SimpleNamespace(wait=lambda: None)

    def settle(self, tolerant=False):
        return set()


def header(kind: int, *counts: int, norm_sq: float = 0.0) -> torch.Tensor:
    head = torch.tensor([kind, *counts, 0, 0], dtype=torch.int64)
    head[7:].view(torch.float64)[1] = norm_sq
    return head


@pytest.mark.parametrize("head, field", [
    (header(99, 0, 0, 0, 0, 0, 0), "kind=99"),
    (header(0, 0, 0, 0, 0, 0, 0), "kind=0"),
    (header(int(Kind.PUSH), 0, 0, 0, 0, -1, 0), "bucket=-1"),
    (header(int(Kind.COMMIT), -3, 0, 0, 4, 0, 0), "clock=-3"),
    (header(int(Kind.GRADS), 0, 0, 0, -5, 0, 0), "samples=-5"),
    (header(int(Kind.COMMIT), 0, 0, 0, 4, 0, 0, norm_sq=-1.0), "norm_sq=-1.0"),
])
def test_a_header_with_an_unknown_kind_or_a_negative_count_is_refused_naming_sender_and_field(head, field):
    with pytest.raises(WireError, match=rf"^parameter-server wire: rank 3 sent .*{field}, which is not accepted"):
        Message.decode(head, 3)
    pull = Message(Kind.PULL, clock=0, version=-2)  # ssp:2 at step 0 asks for at least version -2: fine
    assert Message.decode(pull.encode(), 0) == pull


def serving(bound, tables=(), dispatcher=True):
    """A server of a 2-worker job (ranks 0, 1; it is rank 2), 8 dense parameters in 2 buckets,
    serving a segment of steps 0-1 of 8 samples each."""
    from gradmesh.config import TrainConfig
    from gradmesh.data import GlobalOrderSampler
    from gradmesh.engine.ps.mode import Mode
    from gradmesh.engine.ps.segment import Dispatcher, Segment
    from gradmesh.engine.ps.server import Server

    job = SimpleNamespace(train=TrainConfig(global_batch_size=8, grad_clip=0.0), optimizer_class=torch.optim.SGD,
                          optimizer_kwargs={"lr": 0.1}, step_timeout=0, membership=None,
                          on_nonfinite="stop")
    mode = Mode("async", None) if bound is None else Mode(f"ssp:{bound}", bound)
    server = Server(0, (0, 8), [(0, 4), (4, 8)], torch.zeros(8), RecordingWire(), job, mode, None, list(tables))
    sampler = GlobalOrderSampler(64, 8, seed=0)
    segment = Segment([sampler.next_global() for _ in range(2)], workers=2)
    server.segment, server.workers, server.identities = segment, 2, [0, 1, 2]
    server.dispatcher = Dispatcher(segment, static=True) if dispatcher else None
    server.probe = SimpleNamespace(reached=lambda clock: None)
    server._begin(segment)
    return server


@pytest.mark.parametrize("bound, message, field", [
    (None, Message(Kind.COMMIT, clock=0, chunk=1, samples=0), "samples=0"),  # was ZeroDivisionError
    (0, Message(Kind.COMMIT, clock=0, chunk=1, samples=3), "samples=3"),  # a share has 4
    (0, Message(Kind.COMMIT, clock=7, chunk=0, samples=4), "clock=7"),  # not in the segment
    (0, Message(Kind.COMMIT, clock=0, chunk=2, samples=4), "chunk=2"),  # 2 workers: shares 0 and 1
    (0, Message(Kind.COMMIT, clock=0, chunk=1, samples=4, version=5), "version=5"),  # from the future
    (0, Message(Kind.PUSH, bucket=2), "bucket=2"),  # was IndexError
    (0, Message(Kind.PULL, clock=9), "clock=9"),
    (0, Message(Kind.TAKE, version=7), "version=7"),
    (0, Message(Kind.RETURN, clock=0, chunk=5), "chunk=5"),
    (0, Message(Kind.ROWS, samples=2), "kind=ROWS"),  # this server holds no table: was IndexError
    (0, Message(Kind.PARAMS), "kind=PARAMS"),  # a server's message, sent to a server
])
def test_a_server_refuses_a_header_field_it_cannot_act_on(bound, message, field):
    server = serving(bound)
    with pytest.raises(WireError, match=rf"rank 1 sent a {message.kind.name} message with {field},"):
        server.handle(1, message)
    assert server.applied == 0 and server.version == 0


def test_only_workers_talk_to_a_server_and_only_the_dispatcher_hands_out_shares():
    with pytest.raises(WireError, match=r"rank 2 sent a CANCEL message with sender=2, .*accepted: a worker's rank, 0..1"):
        serving(0).handle(2, Message(Kind.CANCEL))
    with pytest.raises(WireError, match=r"rank 0 sent a TAKE message with kind=TAKE, .*not the dispatcher"):
        serving(0, dispatcher=False).handle(0, Message(Kind.TAKE))


def test_a_well_formed_share_is_still_applied():
    server = serving(0)
    server.wire.payloads = [torch.ones(4)] * 4
    server.handle(1, Message(Kind.TAKE))
    for worker in (0, 1):
        for bucket in (0, 1):
            server.handle(worker, Message(Kind.PUSH, bucket=bucket))
        server.handle(worker, Message(Kind.COMMIT, clock=0, chunk=worker, samples=4))
    assert server.applied == 2 and server.version == 1
    from gradmesh.engine.base import lr_factor

    step = 0.1 * lr_factor(0, server.job.train) * 2  # SGD (lr 0.1, warmed up) of the two shares summed
    assert torch.allclose(server.param.detach(), torch.full((8,), -step))


class Clicks(nn.Module):
    """A user's sparse model: two tables (10 and 7 rows) it declares, and a dense layer shaped as
    the first table (which must not train row-wise)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Embedding(10, 4), nn.Embedding(7, 4)
        self.dense = nn.Linear(4, 10)

    def sparse_tables(self):
        return [self.first, self.second]

    def lookups(self, ids):
        return [ids[:, 0], ids[:, 1]]

    def forward(self, ids):
        return self.dense(self.first(ids[:, 0]) + self.second(ids[:, 1])).sum(dim=1)


def server_tables(server: int):
    from gradmesh.engine.ps.tables import ServerTables, TableShard

    model = Clicks()
    return ServerTables([TableShard(table, 2, server, None, torch.device("cpu"), name)
                         for name, table in [("first", model.first), ("second", model.second)]], lr=0.1)


@pytest.mark.parametrize("bad, accepted", [
    (15, r"ids=15, .*accepted: rows 0..2 of second \(global ids 10..12\) on this server; id 15 is row 5"),
    (17, r"ids=17, .*accepted: global ids 0..16"),  # past the last table: was IndexError
    (-1, r"ids=-1, .*accepted: global ids 0..16"),
])
def test_a_server_refuses_ids_of_rows_it_does_not_hold(bad, accepted):
    """Server 0 of 2 holds rows 0-4 of `first` (global ids 0-4) and 0-2 of `second` (10-12).
    Id 15 is row 5 of `second` (server 1's): before, it read and updated another row silently."""
    tables = server_tables(0)
    for kind in (Kind.ROWS, Kind.GRADS):
        wire = RecordingWire([torch.tensor([3, bad]), torch.zeros(2, 4)])
        with pytest.raises(WireError, match=rf"rank 1 sent a {kind.name} message with {accepted}"):
            tables.message(wire, 1, Message(kind, samples=2))
    assert tables.message(RecordingWire([torch.tensor([3, 11])]), 1, Message(Kind.ROWS, samples=2)).tolist() == [3, 11]


def test_a_worker_refuses_an_id_outside_its_table_before_it_leaves_as_ddp_does():
    """Data parallelism's nn.Embedding raises IndexError for an id past a table's end; a ps
    worker raises the same type, naming the table, the id and the valid range, and sends
    nothing (on the wire, id 10 of `first` would be row 0 of `second`)."""
    from gradmesh.engine.ps.lookup import WorkerTables
    from gradmesh.parallel.ps import Roles, sparse_tables

    bad = torch.tensor([[3, 1], [10, 2]])
    with pytest.raises(IndexError):
        Clicks()(bad)  # as under ddp
    model, wire = Clicks(), RecordingWire()
    tables = WorkerTables(model, sparse_tables(model), Roles(3, 2), wire)
    tables.active = True
    with pytest.raises(IndexError, match=r"^sparse table first looked up id 10, out of its range: it has 10 rows, "
                                         r"ids 0..9$"):
        model(bad)
    assert wire.sent == []


def test_the_tables_that_train_row_wise_are_the_ones_the_model_declares():
    """A dense layer shaped as a table (Linear(4, 10): weight 10 x 4, like `first`) trains with
    the base optimizer, not row-wise Adagrad (before: picked by shape)."""
    from gradmesh.optim import with_rowwise_tables
    from gradmesh.parallel.ps import sparse_tables

    torch.manual_seed(0)
    model = Clicks()
    assert [name for name, _ in sparse_tables(model)] == ["first", "second"]
    reference = nn.Linear(4, 10)
    reference.load_state_dict(model.dense.state_dict())
    optimizer = with_rowwise_tables(torch.optim.AdamW)(model.parameters(), tables=model.sparse_tables(),
                                                       table_lr=0.1, lr=1e-2)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ids = torch.tensor([[1, 2], [3, 4]])
    for _ in range(2):
        optimizer.zero_grad(), plain.zero_grad()
        model(ids).sum().backward()
        reference(model.first(ids[:, 0]).detach() + model.second(ids[:, 1]).detach()).sum().backward()
        optimizer.step(), plain.step()
    assert torch.equal(model.dense.weight, reference.weight)
    assert "sum" in optimizer.state[model.first.weight] and "sum" not in optimizer.state[model.dense.weight]


# 8 tables of 16 rows x 16 and a 16-wide hidden layer: the bottom MLP's last Linear is 16 x 16,
# a table's shape (before, ddp trained it row-wise and ps with AdamW: rel. L2 8e-2 after 5 steps)
SQUARE = ("--model", "recsys", "--set", "model.rows=128", "--set", "model.dim=16", "--set", "model.hidden=16",
          "--set", "model.samples=4000", "--max-steps", "5", "--global-batch-size", "64")


@pytest.mark.slow  # fast-tier budget: the row checks above are unit tests
def test_ddp_and_ps_train_the_same_recsys_model_when_a_dense_layer_has_a_tables_shape(catalogue):
    """Sync, 1 server and 2 workers, against one process (ddp's code path); measured 2e-8."""
    run = catalogue.run(3, *SQUARE, "--strategy", "ps", tiny=False)
    assert rel_l2(weights(run), weights(catalogue.run(1, *SQUARE, tiny=False))) <= 1e-5
