"""`llmlocal chat "message"` killed with SIGKILL mid-reply: the user message and the reply so
far are in the database, and the next start shows the reply as interrupted."""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

from llmlocal.app.history import ChatStore
from llmlocal.app.tui import ChatApp
from llmlocal.app.tui.conversation import MessageView
from llmlocal.engine import Engine, Plan, SamplingParams
from tui_support import TIMEOUT_S, wait_idle

PROMPT = "Write the numbers from 1 to 500, separated by commas."


def start_chat(data_dir: Path) -> tuple[subprocess.Popen[bytes], int]:
    """`llmlocal chat PROMPT` in a pseudo-terminal (Textual wants one), its output drained."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = dict(os.environ, LLMLOCAL_DATA_DIR=str(data_dir), TERM="xterm-256color", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmlocal.app", "chat", PROMPT, "--temperature", "0", "--max-tokens", "1500"],
        stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True, close_fds=True,
    )
    os.close(slave)

    def drain() -> None:  # a full pty buffer would block the app's writes
        try:
            while os.read(master, 65536):
                pass
        except OSError:
            pass

    threading.Thread(target=drain, daemon=True).start()
    return proc, master


def partial_reply(db: Path) -> str | None:
    """The reply being written, once some of it has been saved."""
    if not db.exists():
        return None
    store = ChatStore(db)
    try:
        for chat in store.list_chats():
            messages = store.conversation(chat.id).messages
            if len(messages) == 2 and messages[1].status == "partial" and len(messages[1].content) > 40:
                return messages[1].content
    finally:
        store.close()
    return None


def kill_mid_reply(data_dir: Path) -> str:
    """Run the app until part of its reply is saved, SIGKILL it, return the part seen."""
    proc, master = start_chat(data_dir)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        seen = None
        while seen is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            seen = partial_reply(data_dir / "chats.db")
        assert proc.poll() is None, "the app exited before it was killed"
        assert seen is not None, "no partial reply was saved in time"
        os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)
    assert proc.returncode == -signal.SIGKILL
    return seen


async def test_a_killed_app_leaves_the_partial_reply_in_the_database(engine: Engine, tmp_path: Path) -> None:
    db = tmp_path / "chats.db"
    seen = kill_mid_reply(tmp_path)  # (blocking: no app runs in this event loop yet)

    store = ChatStore(db)
    (chat,) = store.list_chats()
    user, reply = store.conversation(chat.id).messages
    assert (user.role, user.content, user.status) == ("user", PROMPT, "complete")
    assert (reply.role, reply.status, reply.finish_reason) == ("assistant", "partial", None)
    assert reply.content.startswith(seen)  # at least what was seen before the kill
    assert "1, 2, 3" in reply.content
    assert chat.title == PROMPT[:47] + "…"

    # The next start reopens that chat and says the reply was interrupted.
    app = ChatApp(Plan(), SamplingParams(temperature=0, max_tokens=8), engine=engine, store=store)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_idle(pilot)
        assert app.chat.id == chat.id
        view = app.query(MessageView).last()
        assert view.text == reply.content and "interrupted" in view.info.header()
    store.close()
