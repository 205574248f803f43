"""`ChatApp`: the `llmlocal chat` screen.

Sidebar of chats | the conversation and the message box | the live engine panel; a footer
of keys. The app is the one place that reads and writes the store (`ChatStore`) and starts
engine work; widgets render and post messages. The engine is loaded and called in thread
workers (llama.cpp blocks), which post typed messages back (`worker_messages`). Replies, and
everything done with them, live in `ReplyActions`; the model in `ModelActions`; this file
holds the layout, the chats and their settings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from llmlocal.models.errors import LLMLocalError
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Input, Static

from ..history import Chat, ChatStore, Conversation, StoredMessage, data_dir
from .chat_list import ChatItems, ChatList
from .conversation import ConversationView, MessageView
from .dialogs import ConfirmScreen, TextPromptScreen
from .draft_prefill import DraftPrefill
from .engine_panel import WARN_AT, EnginePanel
from .help_screen import HelpScreen, Section, rows_of
from .model_actions import ModelActions
from .prompt_input import PromptInput
from .reply_actions import ReplyActions, ReplyState
from .settings import ChatSettings, ReplyFormat
from .settings_screen import ChatSettingsScreen
from .thread_count import ThreadCount
from .worker_messages import (
    ContextCounted,
    EngineLoaded,
)

if TYPE_CHECKING:
    from llmlocal.engine import Engine, Plan, SamplingParams


class ChatApp(ReplyActions, ModelActions, DraftPrefill, App[None]):
    TITLE = "llmlocal chat"
    CSS_PATH = "chat.tcss"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop", "Stop", priority=True, tooltip="Stop the reply (its text is kept), or stop editing"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+r", "regenerate", "Regenerate", tooltip="Write the last reply again (the old one stays as a branch)"),
        Binding("f2", "pick_model", "Model", tooltip="Pick or switch the model"),
        Binding("f3", "settings", "Settings", tooltip="System prompt and sampling parameters of this chat"),
        Binding("ctrl+f", "search", "Search", tooltip="Search chats by title and content"),
        Binding("f4", "rename_chat", "Rename chat", show=False),
        Binding("f8", "delete_chat", "Delete chat", show=False, tooltip="Delete this chat (asks first)"),
        Binding("f5", "export_chat", "Export chat", show=False,
                tooltip="Export this chat to Markdown in the current directory"),
        Binding("ctrl+up", "focus_message(-1)", "Previous message", show=False),
        Binding("ctrl+down", "focus_message(1)", "Next message", show=False),
        Binding("ctrl+l", "focus_prompt", "Message box", show=False, tooltip="Back to the message box"),
        Binding("f1,question_mark", "help", "Help"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(
        self,
        plan: Plan,
        sampling: SamplingParams | None = None,
        system: str | None = None,
        engine: Engine | None = None,
        store: ChatStore | None = None,
        first_message: str | None = None,
        plan_for: Callable[[str], Plan] | None = None,
        reply_format: ReplyFormat | None = None,
        prefill_draft: bool = True,
    ) -> None:
        """``plan`` loads the first model (unless ``engine`` is given); ``plan_for(name)`` is
        the plan of a model picked later (the CLI runs the planner there; by default, ``plan``
        with the model replaced). Without ``store``, the chats are in the user's data dir.
        ``system``, ``sampling`` and ``reply_format`` are the settings of new chats;
        ``prefill_draft``: prefill the message while it is typed (`DraftPrefill`)."""
        super().__init__()
        from llmlocal.engine import SamplingParams

        self.base_plan = plan
        self.plan_for = plan_for or (lambda name: plan.replace(model=name))
        self.defaults = ChatSettings(system or None, sampling or SamplingParams(), reply_format or ReplyFormat())
        self.engine: Engine | None = engine
        self.owned: list[Engine] = []  # engines this app loaded, and so closes
        self.retired: list[Engine] = []  # replaced engines, closed once no request uses them
        self.loading: str | None = None  # name of the model being loaded
        self.following: str | None = None  # a reopened chat's model, being loaded for it
        self.store = store if store is not None else ChatStore.open()
        self._owns_store = store is None
        self.chat: Chat | None = None  # None: a new chat, stored when its first message is sent
        self.settings = self.defaults
        self.messages: list[StoredMessage] = []  # the shown branch, root first
        self.branches: dict[int, tuple[int, int]] = {}
        self.editing: StoredMessage | None = None  # the user message being rewritten
        self.reply: ReplyState | None = None  # the request in flight (a reply or a summary)
        self.first_message = first_message
        self.warned: set[int | None] = set()  # chats already warned about a nearly full context
        self.threads = ThreadCount()
        self.closing = False
        self.prefill_draft = prefill_draft

    # ---- layout and lifecycle ------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield ChatList(id="sidebar")
            with Vertical(id="center"):
                yield ConversationView(id="messages")
                yield Static("", id="edit-banner", markup=False)
                yield PromptInput(id="prompt", soft_wrap=True, show_line_numbers=False)
            yield EnginePanel(id="engine")
        yield Footer()

    @property
    def conversation(self) -> ConversationView:
        return self.query_one(ConversationView)

    @property
    def panel(self) -> EnginePanel:
        return self.query_one(EnginePanel)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    async def on_mount(self) -> None:
        self.query_one("#edit-banner").display = False
        chats = self.store.list_chats()
        if chats and self.first_message is None:
            await self.open_chat(chats[0].id, follow=False)
        else:
            await self.new_chat()
        self.prompt.focus()
        if self.engine is not None:
            await self.on_engine_loaded(EngineLoaded(self.engine))
        await self.follow_chat_model()  # the reopened chat's own model, if it has another
        if self.engine is None and self.loading is None:
            self.load_model(None)

    async def on_unmount(self) -> None:
        self.closing = True
        self.stop_draft_prefill()
        if self.reply is not None:
            self.stop_reply()  # the reply ends within a token and is stored as stopped
        await asyncio.to_thread(self.threads.wait_idle, 120.0)
        for engine in self.owned:
            engine.close()
        if self._owns_store:
            self.store.close()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":  # Esc: only when there is something to stop, and no dialog is open
            return self.screen is self.screen_stack[0] and (self.reply is not None or self.editing is not None)
        return True

    # ---- chats ---------------------------------------------------------------------------
    async def refresh_sidebar(self) -> None:
        sidebar = self.query_one(ChatList)
        await sidebar.show(self.store.list_chats(sidebar.query_text), self.chat.id if self.chat else None)

    async def open_chat(self, chat_id: int, follow: bool = True) -> None:
        """Show a chat; ``follow``: and load the model it was held with (`follow_chat_model`)."""
        await self.leave_reply()
        self.stop_editing()
        self.chat = self.store.get_chat(chat_id)
        try:
            self.settings = ChatSettings.from_chat(self.chat, self.defaults)
        except LLMLocalError as e:
            self.settings = self.defaults
            self.notify(f"This chat's stored settings are invalid ({e}); using the defaults.", severity="warning")
        await self.show_branch()
        await self.refresh_sidebar()
        if follow:
            await self.follow_chat_model()

    async def new_chat(self) -> None:
        await self.leave_reply()
        self.stop_editing()
        self.chat = None
        self.settings = self.defaults
        await self.show_branch()
        await self.refresh_sidebar()

    async def show_branch(self, focus_depth: int | None = None) -> None:
        """Show the current chat's branch from the store, and the figures of its last reply."""
        if self.chat is None:
            self.messages, self.branches = [], {}
        else:
            conv = self.store.conversation(self.chat.id)
            self.chat, self.messages, self.branches = conv.chat, conv.messages, conv.branches
        await self.conversation.show(self.messages, self.branches)
        state = self.panel.state
        state.clear_reply()
        state.reply_format = self.settings.reply_format.label
        last = next((m for m in reversed(self.messages) if m.role == "assistant" and m.stats), None)
        if last is not None and last.stats:
            state.take_stats(last.stats)
        state.context_tokens = None
        self.panel.render_state()
        self.count_context()
        self.start_draft_prefill()  # the history, for the next message (`DraftPrefill`)
        if focus_depth is not None:
            views = self.conversation.views()
            if views:
                views[min(focus_depth, len(views) - 1)].focus()

    @on(ChatList.Opened)
    async def _opened(self, event: ChatList.Opened) -> None:
        if self.chat is None or event.chat_id != self.chat.id:
            await self.open_chat(event.chat_id)
        self.prompt.focus()

    @on(ChatList.SearchChanged)
    async def _searched(self, event: ChatList.SearchChanged) -> None:
        await self.refresh_sidebar()

    @on(ChatList.RenameRequested)
    def _rename_requested(self, event: ChatList.RenameRequested) -> None:
        self.rename(event.chat_id)

    @on(ChatList.DeleteRequested)
    def _delete_requested(self, event: ChatList.DeleteRequested) -> None:
        self.delete(event.chat_id)

    def rename(self, chat_id: int) -> None:
        async def done(title: str | None) -> None:
            if title:
                renamed = self.store.rename_chat(chat_id, title)
                if self.chat is not None and self.chat.id == chat_id:
                    self.chat = renamed
                await self.refresh_sidebar()

        self.push_screen(TextPromptScreen("Rename chat", self.store.get_chat(chat_id).display_title), done)

    def delete(self, chat_id: int) -> None:
        if self.reply is not None and self.reply.chat_id == chat_id:
            self.notify("A reply is being written in this chat: press Esc to stop it first.", severity="warning")
            return
        chat = self.store.get_chat(chat_id)
        question = (
            f"Delete “{chat.display_title}” and its {self.store.message_count(chat_id)} messages? "
            "This cannot be undone."
        )

        async def done(yes: bool | None) -> None:
            if not yes:
                return
            self.store.delete_chat(chat_id)
            if self.chat is not None and self.chat.id == chat_id:
                rest = self.store.list_chats()
                await (self.open_chat(rest[0].id) if rest else self.new_chat())
            else:
                await self.refresh_sidebar()
            self.notify(f"Deleted “{chat.display_title}”.")

        self.push_screen(ConfirmScreen(question), done)

    async def action_new_chat(self) -> None:
        await self.new_chat()
        self.prompt.focus()

    def action_rename_chat(self) -> None:
        if self.chat is None:
            self.notify("This chat is not saved yet: send a message first.", severity="warning")
        else:
            self.rename(self.chat.id)

    def action_delete_chat(self) -> None:
        if self.chat is not None:
            self.delete(self.chat.id)

    def action_export_chat(self) -> None:
        if self.chat is None:
            self.notify("This chat is not saved yet: send a message first.", severity="warning")
            return
        try:
            path = export_markdown(self.store.conversation(self.chat.id))
        except (LLMLocalError, OSError) as e:
            self.notify(f"Could not export this chat: {e}", severity="error", markup=False)
            return
        self.notify(f"Exported “{self.chat.display_title}” to {path}", timeout=8, markup=False)

    def action_search(self) -> None:
        self.query_one("#chat-search", Input).focus()

    def action_focus_prompt(self) -> None:
        self.prompt.focus()

    def action_focus_message(self, step: int) -> None:
        views = self.conversation.views()
        if not views:
            return
        focused = self.focused
        index = views.index(focused) + step if isinstance(focused, MessageView) else (len(views) - 1 if step < 0 else 0)
        if 0 <= index < len(views):
            views[index].focus()
            views[index].scroll_visible()
        elif index >= len(views):
            self.prompt.focus()

    # ---- settings and help ---------------------------------------------------------------
    def action_settings(self) -> None:
        title = self.chat.display_title if self.chat else "New chat"

        async def done(settings: ChatSettings | None) -> None:
            if settings is None:
                return
            self.settings = settings
            if self.chat is not None:
                self.chat = self.store.update_chat(
                    self.chat.id,
                    system_prompt=settings.system_prompt,
                    clear_system_prompt=settings.system_prompt is None,
                    sampling=settings.sampling_dict(),
                )
            self.notify("Chat settings saved.")
            self.panel.state.reply_format = settings.reply_format.label
            self.panel.render_state()
            self.count_context()

        self.push_screen(ChatSettingsScreen(self.settings, title), done)

    def help_sections(self) -> list[Section]:
        return [
            ("Chat", rows_of(self.BINDINGS)),
            ("Message box", [("Enter", "Send"), ("Shift+Enter Ctrl+J", "New line")]),
            ("A message (Ctrl+↑ / Ctrl+↓ or a click to select it)", rows_of(MessageView.BINDINGS)),
            ("Chat list", [("Enter", "Open"), *rows_of(ChatItems.BINDINGS)]),
        ]

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.help_sections()))

    # ---- context -------------------------------------------------------------------------
    def count_context(self) -> None:
        """Count the shown conversation's prompt tokens (in a worker: it tokenizes)."""
        if self.engine is None:
            return
        history = self.settings.system_messages() + [{"role": m.role, "content": m.content} for m in self.messages]
        leaf = self.messages[-1].id if self.messages else None
        self._count_worker(self.engine, self.chat.id if self.chat else None, leaf, history)

    @work(thread=True, group="count", exclusive=True)
    def _count_worker(self, engine: Engine, chat_id: int | None, leaf: int | None, history: list[dict[str, str]]) -> None:
        try:
            with self.threads.running():
                tokens = engine.count_tokens(history) if history and not self.closing else 0
        except LLMLocalError:
            return  # the template refused the conversation: sending will say why
        self.post_message(ContextCounted(chat_id, leaf, tokens))

    def on_context_counted(self, message: ContextCounted) -> None:
        leaf = self.messages[-1].id if self.messages else None
        current = self.chat.id if self.chat else None
        if self.reply is not None or (message.chat_id, message.leaf_id) != (current, leaf):
            return  # stale: the conversation changed since
        self.panel.state.context_tokens = message.tokens
        self.panel.render_state()
        self.warn_if_nearly_full()

    def warn_if_nearly_full(self) -> None:
        share = self.panel.state.context_share
        key = self.chat.id if self.chat else None
        if share is None or share < WARN_AT or key in self.warned:
            return
        self.warned.add(key)
        state = self.panel.state
        self.notify(
            f"This chat fills {share:.0%} of the context window ({state.context_tokens}/{state.n_ctx} tokens): "
            "the next message may not fit. You will be asked what to do; nothing is dropped silently.",
            severity="warning",
            timeout=8,
        )


def export_markdown(conv: Conversation) -> Path:
    """Write a chat's shown branch as Markdown into the current directory, or into the data
    directory's exports/ where the current one cannot be written; return the file's path."""
    from ..commands.chats import conversation_markdown, write_atomic

    name = f"llmlocal-chat-{conv.chat.id}.md"
    text = conversation_markdown(conv)
    try:
        path = Path.cwd() / name
        write_atomic(path, text)
    except (LLMLocalError, OSError):
        folder = data_dir() / "exports"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        write_atomic(path, text)
    return path
