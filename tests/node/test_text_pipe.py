import asyncio
import threading

from workers.node.textpath import TextPipe


async def test_text_from_a_thread_arrives_in_order_and_ends_once():
    pipe = TextPipe(asyncio.get_running_loop())
    pieces = [f"p{i} " for i in range(500)]

    def produce() -> None:
        for p in pieces:
            pipe.put(p)
        pipe.close()

    threading.Thread(target=produce).start()
    got = []
    while (text := await pipe.take(quiet_s=5)) is not None:
        got.append(text)
    assert "".join(got) == "".join(pieces)
    assert len(got) < len(pieces)  # batched: far fewer wake-ups than tokens
    assert await pipe.take(quiet_s=0.1) is None


async def test_a_quiet_pipe_returns_empty_text_so_the_caller_can_heartbeat():
    pipe = TextPipe(asyncio.get_running_loop())
    assert await pipe.take(quiet_s=0.05) == ""
    pipe.put("x")
    assert await pipe.take(quiet_s=1) == "x"


async def test_each_take_counts_the_tokens_of_the_text_taken():
    pipe = TextPipe(asyncio.get_running_loop())
    pipe.put("a", 1)
    pipe.put("bc", 3)  # "bc" completes tokens 2 and 3
    assert await pipe.take(quiet_s=1) == "abc" and pipe.tokens_taken == 3
    pipe.put("d", 4)
    pipe.close()
    assert await pipe.take(quiet_s=1) == "d" and pipe.tokens_taken == 4


async def test_a_cancel_that_comes_with_text_is_never_swallowed():
    """The generate activity learns of its cancellation once, as a CancelledError at
    whatever it awaits; arriving in the same turn as the engine's text, it must still
    surface (asyncio.wait_for on Python 3.11 returned the text instead, and the cancelled
    prompt ran to its end)."""
    loop = asyncio.get_running_loop()
    for spins in range(6):  # every position of the cancel against the wake-up
        for _ in range(20):
            pipe = TextPipe(loop)
            take = asyncio.ensure_future(pipe.take(quiet_s=5))
            await asyncio.sleep(0)  # take is waiting
            pipe.put("x")  # the engine thread's wake-up, scheduled on the loop
            for _ in range(spins):
                await asyncio.sleep(0)
            if take.done():
                continue  # the text was taken before the cancel: nothing to lose
            take.cancel()
            try:
                await take
            except asyncio.CancelledError:
                continue
            raise AssertionError(f"a cancel {spins} loop turn(s) after the text was lost")
