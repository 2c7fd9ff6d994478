"""How long one read-back takes through the side channel alone (hf_kvshare.serving.channel): a
1,100-token request of the embedded SmolLM2-135M (30 layers x 3 KV heads x 64, fp32: keys and values
47 MB together) sent by a ``Sender`` and delivered by a ``Receiver`` in this process, five rounds.

    OMP_NUM_THREADS=1 python docs/results/channel_transfer.py
"""

import threading
import time

import torch

from hf_kvshare.serving import channel


def main(rounds: int = 5) -> None:
    torch.set_num_threads(1)
    keys = torch.randn(30, 1100, 3, 64)
    values = torch.randn_like(keys)
    delivered, arrived = [], threading.Event()

    def deliver(request_id, k, v, via):
        delivered.append(time.perf_counter())
        arrived.set()

    receiver = channel.Receiver(deliver)
    sender = channel.Sender(receiver.address)
    try:
        deadline = time.monotonic() + 10
        while not sender.send("warm-up", keys[:, :1], values[:, :1]) and time.monotonic() < deadline:
            time.sleep(0.01)  # the connection completes asynchronously
        arrived.wait(10)
        for i in range(rounds):
            arrived.clear()
            t0 = time.perf_counter()
            assert sender.send(f"r{i}", keys, values, "at finish")
            sent = time.perf_counter() - t0
            assert arrived.wait(10)
            print(f"round {i}: send {sent:.4f} s, delivered (decoded) {delivered[-1] - t0:.4f} s")
    finally:
        sender.close()
        receiver.close()


if __name__ == "__main__":
    main()
