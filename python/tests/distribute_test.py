"""hybrid_paramd.distribute + ClusterOptimizer against a real cluster
(coordinator + 2 daemons, SGD on the daemons): the ordinary torch loop
(forward, backward, opt.step(), opt.zero_grad()) trains a module whose
weights live in the cluster, and its parameters follow torch's own SGD on
the same batches; two pushers with half the batch each (data parallel)
equal one pusher with the whole batch; a parameter without a gradient is
named before anything is pushed; the recipe presets name the Linear
weights."""

import threading
import unittest

import test_env  # noqa: F401  (sys.path)

import torch

import hybrid_paramd as hp
from hybrid_paramd import cluster as hpc
from hybrid_paramd import cluster_module as hpd

LR = 0.05
# Every tensor's copies are its FP32 master (not its BF16 rounding): the
# cluster's arithmetic is then torch's.
FP32 = 'name: "fp32" default_spec { rowwise { format: IDENTITY_FP32 } ' \
       'columnwise { format: IDENTITY_FP32 } columnwise_usage: true source_dtype: FP32 }'


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 5)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def batches(n, size, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 12, generator=g), torch.randint(0, 5, (size,), generator=g))
            for _ in range(n)]


def reference(start, data):
    """torch's own SGD from the same weights on the same batches."""
    ref = Net()
    ref.load_state_dict(start)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for x, y in data:
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return ref


def cluster(pushers):
    return hpc.LocalCluster(test_env.SERVER, daemons=2, expected_pushers=pushers,
                            daemon_flags=["--optimizer=sgd", "--lr=%g" % LR])


def trained(model):
    """The module's parameters as the cluster holds them now (FP32)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class DistributeTest(unittest.TestCase):

    def assert_close(self, got, want, what):
        for n, w in want.items():
            torch.testing.assert_close(got[n], w, rtol=2e-5, atol=2e-6,
                                       msg=lambda m: "%s %s: %s" % (what, n, m))

    def test_the_ordinary_loop_follows_torch_sgd(self):
        torch.manual_seed(1)
        model = Net()
        start = {k: v.clone() for k, v in model.state_dict().items()}
        data = batches(5, 16, 2)
        with cluster(1) as cl, hp.Client(cl.address) as client:
            model = hp.distribute(model, client, recipe=FP32)
            opt = hp.ClusterOptimizer(model)
            self.assertEqual(opt.version, 0)
            for x, y in data:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            self.assertEqual(opt.version, len(data))
            self.assertGreater(opt.last_stats["rowwise_bytes"], 0)
            # The Linear weights are computed from the fetched copies; the
            # model's own parameters hold the rest: read the cluster's.
            sd = client.state_dict(dtype=torch.float32)
        ref = reference(start, data)
        self.assert_close(sd, dict(ref.named_parameters()), "cluster vs torch SGD")
        # The forward pass runs on the new version.
        x = data[0][0]
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-5)

    def test_two_pushers_with_half_the_batch_equal_one_with_all_of_it(self):
        torch.manual_seed(4)
        first = Net()
        start = {k: v.clone() for k, v in first.state_dict().items()}
        second = Net()
        second.load_state_dict(start)
        data = batches(3, 16, 5)
        errors = []
        with cluster(2) as cl:
            clients = [hp.Client(cl.address, name="rank%d" % r) for r in range(2)]
            loaded = threading.Event()

            def rank(r, model):
                try:
                    if r == 1:
                        loaded.wait(60)
                    model = hp.distribute(model, clients[r], recipe=FP32, load=(r == 0))
                    if r == 0:
                        loaded.set()
                    opt = hp.ClusterOptimizer(model)
                    for x, y in data:
                        half = slice(8 * r, 8 * r + 8)
                        torch.nn.functional.cross_entropy(model(x[half]), y[half]).backward()
                        opt.step()
                        opt.zero_grad()
                    self.assertEqual(opt.version, len(data))
                except Exception as e:  # noqa: BLE001 (reported below)
                    loaded.set()
                    errors.append(e)

            threads = [threading.Thread(target=rank, args=(r, m))
                       for r, m in ((0, first), (1, second))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            self.assertEqual(errors, [])
            sd = clients[0].state_dict(dtype=torch.float32)
            for c in clients:
                c.close()
        ref = reference(start, data)
        self.assert_close(sd, dict(ref.named_parameters()), "2 pushers vs 1")

    def test_a_parameter_without_a_gradient_is_named(self):
        torch.manual_seed(7)

        class Unused(Net):
            def __init__(self):
                super().__init__()
                self.spare = torch.nn.Linear(12, 12)

        with cluster(1) as cl, hp.Client(cl.address) as client:
            model = hp.distribute(Unused(), client, recipe="bf16")
            opt = hp.ClusterOptimizer(model)
            x, y = batches(1, 4, 8)[0]
            torch.nn.functional.cross_entropy(model(x), y).backward()
            with self.assertRaises(ValueError) as e:
                opt.step()
            self.assertIn("spare.weight", str(e.exception))
            self.assertIn("spare.bias", str(e.exception))
            self.assertEqual(client.wait_for_version(0), 0)  # nothing was pushed
            # missing_grads="zero" pushes zeros for them.
            opt = hp.ClusterOptimizer(model, missing_grads="zero")
            opt.step()
            self.assertEqual(opt.version, 1)
        with self.assertRaises(TypeError):
            hp.ClusterOptimizer(Net())

    def test_presets_name_the_linear_weights(self):
        text = hpd.recipe_text(Net(), "mxfp8")
        self.assertIn('pattern: "fc1\\\\.weight|fc2\\\\.weight"', text)
        self.assertIn("rowwise { format: MXFP8 } columnwise { format: MXFP8 }", text)
        self.assertIn("default_spec { rowwise { format: IDENTITY_BF16 }", text)
        self.assertIn("IDENTITY_BF16", hpd.recipe_text(Net(), None))
        with self.assertRaises(ValueError):
            hpd.recipe_text(Net(), "fp7")


if __name__ == "__main__":
    unittest.main(verbosity=2)
