"""Render conversations to token ids and a loss mask, per chat format.

A renderer produces text segments, each marked trainable or not; the whole text is tokenized once
(so ids equal what `apply_chat_template` + the tokenizer give) and a token is loss-bearing when its
characters overlap a trainable segment. Assistant turns are trainable including `<end_of_turn>`.

Chat formats:
- `gemma` / `functiongemma`: our own Gemma 3 turns, tools in the FunctionGemma text format (the two
  differ only in the vocabulary: markers the tokenizer lacks are mapped onto `<unusedN>`).
- `template`: the tokenizer's own chat template (`tokenizer.chat_template`). Each assistant message's
  trainable span is found by rendering the conversation up to it with and without it: the text the
  template adds for the assistant message (less trailing whitespace after its end marker) is
  trainable. A template that re-renders earlier turns differently (not prefix-stable) is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from gemma_tpu.core.errors import UserError
from gemma_tpu.data.records import Markup
from gemma_tpu.formats import function_calling as fc
from gemma_tpu.formats import gemma_chat as chat


@dataclasses.dataclass
class Rendered:
    ids: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # bool [n]; True where the token is a training target
    text: str  # the text tokenized (after marker mapping, without the leading BOS)
    offsets: np.ndarray | None = None  # int32 [n, 2] character span of each token in `text`; BOS is (0, 0)
    untrained_tail: bool = False  # turns after the last trained one were left out (see `Renderer.render`)
    partial: bool = False  # only the start of a very long text was tokenized (`max_tokens`): len(ids) is a lower bound
    # the first token that holds both the end of a prompt and the start of the trained text after it (see `joined_at`)
    joined: str | None = None


def gemma_segments(conv: dict, add_generation_prompt: bool = False,
                   continue_final: bool = False) -> list[tuple[str, bool]]:
    """Gemma 3 turns; system/developer text folds into the first user turn; tools in FunctionGemma
    form (declarations in a developer turn, calls and responses inside the model turn). `continue_final`: the last
    message is the start of an assistant answer, left open for the model to continue (`Renderer.render`)."""
    msgs = list(conv["messages"])
    segs: list[tuple[str, bool]] = []
    preamble = ""
    if msgs and msgs[0]["role"] in ("system", "developer"):
        preamble = msgs.pop(0)["content"]
    tools = conv.get("tools")
    if tools:
        decl = "".join(fc.format_declaration(t) for t in tools)
        segs.append((chat.turn(chat.DEVELOPER, f"{preamble}{decl}"), False))
        preamble = ""
    in_model_turn = False
    response_open = False  # the last trained text ended with the response marker
    for i, m in enumerate(msgs):
        role = m["role"]
        if role in ("user", "system", "developer"):
            if in_model_turn:
                segs.append((chat.close_turn(), False))
                in_model_turn = False
                response_open = False
            text = m["content"]
            if preamble:
                text = f"{preamble}\n\n{text}"
                preamble = ""
            segs.append((chat.turn(chat.USER, text), False))
        elif role == "assistant":
            if not in_model_turn:
                segs.append((chat.open_turn(chat.MODEL), False))
            if continue_final and i == len(msgs) - 1:  # its text as training renders a given start: context
                segs.append((m["content"], False))
                return segs
            body = m["content"] + "".join(fc.format_call(c["name"], c["arguments"]) for c in m.get("tool_calls", []))
            given = m.get("given", 0)  # the start of the answer a prompt gave (TRL's continue_final_message): context
            if given:
                segs.append((body[:given], False))
                body = body[given:]
            if m.get("tool_calls"):
                # The model ends a call by emitting the response marker; the tool's answer follows.
                segs.append((body + fc.START_RESPONSE, m.get("train", True)))
                in_model_turn = True
                response_open = True
            else:
                segs.append((body + chat.END_OF_TURN, m.get("train", True)))
                segs.append(("\n", False))
                in_model_turn = False
                response_open = False
        elif role == "tool":
            resp = fc.format_response(m.get("name") or "", m["content"])
            if response_open:
                # the opening marker was already emitted (and trained) at the end of the call
                resp = resp[len(fc.START_RESPONSE):]
            elif not in_model_turn:
                segs.append((chat.open_turn(chat.MODEL), False))
            # a second result of parallel calls opens its own response marker
            segs.append((resp, False))
            in_model_turn = True
            response_open = False
    if in_model_turn and add_generation_prompt:
        pass
    elif add_generation_prompt:
        segs.append((chat.open_turn(chat.MODEL), False))
    return segs


def text_segments(text: str, eos: str | None) -> list[tuple[str, bool]]:
    """A `text` row as TRL's SFTTrainer trains it: the text and EOS (unless it already ends with it), all
    trained; without the EOS the model never learns to stop."""
    return [(text if not eos or text.endswith(eos) else text + eos, True)]


CHAT_FORMATS = ("gemma", "functiongemma", "template")
LOSS_ON = ("assistant", "all")


def template_messages(messages: list[dict]) -> list[dict]:
    """Normalised messages in the shape Hugging Face chat templates expect.

    Call arguments are objects (vLLM parses the JSON text a client sends into one); a tool result is its text, as
    vLLM and transformers serve hand a client's result to the template (OpenAI's tool message content is text): a
    JSON object result passed as an object was written `{'steps': 5}` by a template writing the content as it is,
    where the served model is shown `{"steps": 5}` (our tool template reads a JSON text field by field either way).
    Content given as text parts is those parts (vLLM's `openai` content format): a template that trims each part
    (Google's Gemma 3 template) was handed them joined, and the trained text was not the served one, nor was the
    difference seen (`Renderer.template_difference`).
    """
    out = []
    for m in messages:
        # content given as text parts goes as those parts, as vLLM hands them over (`records._text_parts`)
        parts = [{"type": "text", "text": p} for p in m.get("text_parts") or ()]
        msg: dict[str, Any] = {"role": m["role"], "content": parts or m.get("content") or ""}
        if m.get("tool_calls"):
            msg["tool_calls"] = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in m["tool_calls"]]
        if m["role"] == "tool" and m.get("name"):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def template_tools(tools: list[dict] | None) -> list[dict] | None:
    """Tool declarations as vLLM hands them to a chat template: each in OpenAI's shape, `{"type": "function",
    "function": {...}}` (a flat declaration, as LLaMA-Factory rows and many datasets keep them, wrapped: a client
    must send it so), its `description` and `parameters` None where not given (vLLM's request model dumps them so).
    Passed as the file held them, a template writing `tools | tojson` trained text no server writes, and one reading
    `tool.function.name` refused every such row. Keys in the dump's order (`tojson` keeps the order it is given)."""
    if not tools:
        return None
    out = []
    for t in tools:
        fn = t.get("function", t)
        own = ("name", "description", "parameters")
        out.append({"type": t.get("type", "function") if "function" in t else "function",
                    "function": {**{k: fn.get(k) for k in own}, **{k: v for k, v in fn.items() if k not in own}},
                    **({k: v for k, v in t.items() if k not in ("type", "function")} if "function" in t else {})})
    return out


def missing_turn_token(tokenizer) -> str | None:
    """The first of Gemma 3's turn markers the vocabulary lacks as a token (None: it has both)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    for marker in (chat.START_OF_TURN, chat.END_OF_TURN):
        tid = tokenizer.convert_tokens_to_ids(marker)
        if tid is None or tid == unk:
            return marker
    return None


def resolve_chat_format(tokenizer, requested: str, family_chat_format: str) -> str:
    """`data.chat_format`, with auto read as the family's format - or as the tokenizer's own template where the
    vocabulary lacks the turn tokens our Gemma format writes and has a template to write its own (a real Gemma 4
    tokenizer: `<|turn>`...`<turn|>`; our format would be refused on it, see `Renderer`)."""
    if requested != "auto":
        return requested
    if (family_chat_format != "template" and getattr(tokenizer, "chat_template", None)
            and missing_turn_token(tokenizer)):
        return "template"
    return family_chat_format


class Renderer:
    """Tokenize rendered segments with one tokenizer call, mapping trainable spans to tokens."""

    def __init__(self, tokenizer, chat_format: str = "gemma", loss_on: str = "assistant",
                 token_map: dict[str, str] | None = None, vocab_size: int | None = None):
        self.tokenizer = tokenizer
        # the model's embedding rows: an id past them is silently clamped by XLA's gather (NaN or wrong
        # losses), so a tokenizer that does not belong to the model is refused at rendering
        self.vocab_size = vocab_size
        self.chat_format = chat_format
        self.loss_on = loss_on
        # Markers the vocabulary lacks (plain Gemma 3 has no FunctionGemma tokens) are mapped onto
        # reserved <unusedN> tokens by text substitution before tokenization.
        self.token_map = token_map or {}
        if chat_format not in CHAT_FORMATS:
            raise UserError(f"data.chat_format {chat_format!r} is not supported ({', '.join(CHAT_FORMATS)})")
        if loss_on not in LOSS_ON:
            raise UserError(f"data.loss_on {loss_on!r} is not supported ({', '.join(LOSS_ON)})")
        if chat_format == "template" and not getattr(tokenizer, "chat_template", None):
            raise UserError(f"data.chat_format=template, but the tokenizer "
                            f"{getattr(tokenizer, 'name_or_path', '') or ''} has no chat template")
        if chat_format != "template":
            self._check_turn_tokens()
        self.markup = Markup(self.control_tokens(), calls=(*fc.FUNCTION_MARKERS, *self.token_map.values()))
        bos = getattr(tokenizer, "bos_token_id", None)
        self.bos_id = chat.BOS_ID if bos is None else int(bos)
        self.bos_text = getattr(tokenizer, "bos_token", None) or ""
        self._renders_tools = False  # the chat template was seen to write `tools` (`_check_renders_tools`)
        self._renders_results = False  # ... and a tool result's content (`_check_renders_results`)

    def _check_turn_tokens(self) -> None:
        """Our Gemma format writes Gemma 3's turn markers: a vocabulary without them as tokens (Gemma 4's turns are
        `<|turn>`...`<turn|>`) tokenized them as plain text pieces, and the run trained on markup the model has never
        seen, without a word."""
        missing = missing_turn_token(self.tokenizer)
        if missing:
            name = getattr(self.tokenizer, "name_or_path", "") or ""
            fix = ("set data.chat_format=template to render with its own chat template"
                   if getattr(self.tokenizer, "chat_template", None) else
                   "it has no chat template either: give the model's own tokenizer")
            raise UserError(f"data.chat_format={self.chat_format} writes Gemma 3's turn markup, but the tokenizer "
                            f"{name + ' ' if name else ''}has no {missing!r} token (Gemma 4 marks its turns "
                            f"with tokens of its own): {fix}")

    def control_tokens(self) -> list[str]:
        """What message text must not hold (see `records.Markup`): every special token of the vocabulary (the
        tokenizer reads each as its control id wherever it stands: a Gemma 4 `<|turn>`, a Gemma 3 `<unused2>`), the
        media markers it has (`gemma_chat.MEDIA_MARKERS`: Gemma 3's `<start_of_image>` is not flagged special),
        and the markers our own Gemma format writes and maps (`<start_function_call>` where the vocabulary
        lacks it)."""
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        specials = [t.content for t in added.values() if getattr(t, "special", False)]
        specials += [t for t in getattr(self.tokenizer, "all_special_tokens", ()) if isinstance(t, str)]
        # whitespace or a single character flagged special is ordinary text however the vocabulary files it
        specials = [t for t in specials if len(t) > 1 and t.strip()]
        # media markers the vocabulary has, special or not (the tokenizer reads any added token as its id)
        specials += [t.content for t in added.values() if t.content in chat.MEDIA_MARKERS]
        own = () if self.chat_format == "template" else (chat.START_OF_TURN, chat.END_OF_TURN, *fc.FUNCTION_MARKERS)
        return [*specials, *own, *self.token_map.values()]

    def prompt_parts(self, conv: dict, total: int, max_tokens: int | None = None) -> list[tuple[str, int]] | None:
        """A generation prompt's `total` tokens (`conv` rendered with add_generation_prompt) by part, in order, as
        (name, count): the system prompt and the tool declarations where given (PROMPT_PARTS), the question with its
        turn's markup, and the turns after it where there are; for an error that says which part passes a context
        (`gemma_tpu.infer.generate.context_excess`). None where the conversation does not open with them (no system
        prompt and no tools given, no question after them), the format cannot render them apart, or one is past
        `max_tokens`."""
        return _prompt_parts(self, conv, total, max_tokens)

    def segments(self, conv: dict, add_generation_prompt: bool = False,
                 continue_final: bool = False) -> list[tuple[str, bool]]:
        if "text" in conv:  # a language-modeling row: no chat markup, every token trained
            return text_segments(conv["text"], getattr(self.tokenizer, "eos_token", None))
        if self.chat_format == "template":
            return self.template_segments(conv, add_generation_prompt, continue_final)
        return gemma_segments(conv, add_generation_prompt, continue_final)

    def _apply(self, messages: list[dict], tools, add_generation_prompt: bool, where: str,
               continue_final: bool = False) -> str:
        """The template's text; `continue_final`: up to the end of the last message's text, left open (the
        tokenizer's continue_final_message), as a server renders a prompt that ends in the start of an answer."""
        more = {"continue_final_message": True} if continue_final else {}
        try:
            return self.tokenizer.apply_chat_template(messages, tools=template_tools(tools), tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **more)
        except Exception as e:  # jinja2 TemplateError, raise_exception() in the template, ...
            raise UserError(f"{where}: the tokenizer's chat template refused the conversation "
                            f"({type(e).__name__}: {str(e)[:200]})") from None

    def template_segments(self, conv: dict, add_generation_prompt: bool = False,
                          continue_final: bool = False) -> list[tuple[str, bool]]:
        """Segments from the tokenizer's own template; assistant spans found by prefix differences. `continue_final`:
        the last message is the start of an answer, rendered as the template continues it (`Renderer.render`)."""
        where = conv.get("where") or "example"
        msgs = template_messages(conv["messages"])
        tools = conv.get("tools")
        segs: list[tuple[str, bool]] = []
        done = ""  # text covered by the segments so far

        def unstable(what: str) -> UserError:
            return UserError(f"{where}: the tokenizer's chat template is not prefix-stable ({what}); its assistant "
                             f"spans cannot be located - use data.chat_format=gemma")

        if tools:
            self._check_renders_tools(msgs, tools, where)
        self._check_renders_results(msgs, tools, where)
        for i, m in enumerate(msgs[:-1] if continue_final else msgs):
            if m["role"] != "assistant" or i == 0:
                continue
            given = conv["messages"][i].get("given", 0)
            if given:  # the answer's start is the prompt's (see `gemma_segments`): rendered as a server continues it
                start = {"role": "assistant", "content": conv["messages"][i]["content"][:given]}
                prompt = self._apply(msgs[:i] + [start], tools, False, where, continue_final=True)
            else:
                prompt = self._apply(msgs[:i], tools, True, where)
            full = self._apply(msgs[:i + 1], tools, False, where)
            if not prompt.startswith(done):
                raise unstable(f"the prompt before messages[{i}] does not extend the earlier turns")
            if not full.startswith(prompt):
                raise unstable(f"messages[{i}] does not extend the prompt before it")
            answer = full[len(prompt):].rstrip()  # whitespace after the end marker is not generated
            # a template that renders no tool calls (Gemma 3's) trained an answer of '<end_of_turn>' alone for a call
            unnamed = [c["name"] for c in conv["messages"][i].get("tool_calls") or [] if c["name"] not in answer]
            if unnamed:
                raise UserError(f"{where}: the tokenizer's chat template does not render messages[{i}]'s tool call "
                                f"{unnamed[0]!r} (the answer it renders, {answer[:80]!r}, does not name it): the call "
                                f"would train as that text - use data.chat_format=gemma, or a template that renders "
                                f"tool calls")
            segs.append((prompt[len(done):], False))
            segs.append((answer, conv["messages"][i].get("train", True)))
            done = prompt + answer
        final = self._apply(msgs, tools, add_generation_prompt, where, continue_final=continue_final)
        if not final.startswith(done):
            raise unstable("the whole conversation does not extend its turns")
        segs.append((final[len(done):], False))
        return [(t, tr) for t, tr in segs if t]

    def _check_renders_tools(self, msgs: list[dict], tools: list, where: str) -> None:
        """Refuse a chat template that ignores `tools` (the conversation renders the same without them; once it is
        seen to write them, not checked again): the declarations were left out of every prompt trained, without a
        word."""
        if not self._renders_tools:
            with_tools = self._apply(msgs, tools, False, where)
            try:
                self._renders_tools = with_tools != self._apply(msgs, None, False, where)
            except UserError:  # a template that needs the declarations of the calls: it reads them
                self._renders_tools = True
        if not self._renders_tools:
            raise UserError(f"{where}: the tokenizer's chat template does not render the tool declarations (the "
                            f"conversation renders the same without them): the model would be trained without its "
                            f"tools - use data.chat_format=gemma, or a template that renders tools")

    def _check_renders_results(self, msgs: list[dict], tools: list | None, where: str) -> None:
        """Refuse a chat template that renders a tool result as nothing or without its content (the conversation
        renders the same whatever its first result holds; once it is seen to write one, not checked again): the answers
        after the results were trained, and served, on prompts without them - the model learnt to answer results it is
        never shown, without a word."""
        k = next((i for i, m in enumerate(msgs) if m["role"] == "tool"), None)
        if self._renders_results or k is None:
            return
        other = {**msgs[k], "content": "0" if msgs[k]["content"] != "0" else "1"}
        try:
            self._renders_results = (self._apply(msgs, tools, False, where)
                                     != self._apply(msgs[:k] + [other] + msgs[k + 1:], tools, False, where))
        except UserError:  # a template that reads the result (refusing text where it wants an object): it writes it
            self._renders_results = True
        if not self._renders_results:
            raise UserError(f"{where}: the tokenizer's chat template does not render messages[{k}]'s tool result (the "
                            f"conversation renders the same whatever it holds): the model would be trained to answer "
                            f"results it is never shown - use data.chat_format=gemma, or a template that renders tool "
                            f"results")

    def compares_with_template(self, conv: dict) -> bool:
        """Whether `template_difference` compares `conv` with the tokenizer's own chat template: a chat rendered by our
        Gemma format where the tokenizer has a template. A tool chat is compared where the vocabulary has the
        FunctionGemma markers as tokens (FunctionGemma, a merged tool-calling fine-tune), whose template is the one
        served; a vocabulary that lacks them (plain Gemma 3) is served with the tool template the merge writes
        (`convert.tool_tokens`), which renders as training does, whatever template the tokenizer has now."""
        if self.chat_format == "template" or "text" in conv or not getattr(self.tokenizer, "chat_template", None):
            return False
        if not conv.get("tools"):
            return True
        if getattr(self, "_lacks_markers", None) is None:
            self._lacks_markers = bool(fc.function_token_map(self.tokenizer))
        return not self._lacks_markers

    def template_difference(self, conv: dict) -> str | None:
        """Where our Gemma rendering of a chat departs from the tokenizer's own chat template, which is what a server
        (vLLM) renders the same conversation with: a template that trims message text (as Google's Gemma 3 template
        does), writes the system prompt otherwise, or renders tool declarations, calls or results otherwise (a template
        that writes a JSON tool result as the text it is) trains text the served model never sees. None: they agree,
        or there is nothing to compare (`compares_with_template`). A chat the template refuses that we render (a
        leading `developer` message, folded like system; Gemma 3's templates take only system) is a difference too: a
        server refuses it as sent, so no client can send the prompt trained on."""
        if not self.compares_with_template(conv):
            return None
        ours = self.map_markers("".join(t for t, _ in gemma_segments(conv)))
        try:
            theirs = self._apply(template_messages(conv["messages"]), conv.get("tools"), False, "")
        except UserError as e:
            return f"the template refuses it{str(e).partition('refused the conversation')[2]}"
        theirs = theirs.removeprefix(self.bos_text)
        if theirs != ours:
            i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            around = slice(max(0, i - 20), i + 20)
            return f"at character {i}, ours {ours[around]!r}, the template's {theirs[around]!r}"
        return self._given_start_difference(conv)

    def _given_start_difference(self, conv: dict) -> str | None:
        """`template_difference` of the prompts that end in an answer's given start (TRL's continue_final_message
        rows): a template that trims message text continues "The answer is " after "The answer is", so the served
        model generates " 42." where ours trains "42." after the space, though the whole conversations agree."""
        msgs = conv["messages"]
        for k, m in enumerate(msgs):
            given = m.get("given", 0) if m["role"] == "assistant" else 0
            if not given:
                continue
            start = {"role": "assistant", "content": m["content"][:given]}
            ours = self.map_markers("".join(t for t, _ in gemma_segments(
                {"messages": msgs[:k] + [start], "tools": conv.get("tools")}, continue_final=True)))
            what = f"messages[{k}]'s given start, continued (continue_final_message)"
            try:
                theirs = self._apply(template_messages(msgs[:k]) + [start], conv.get("tools"), False, "",
                                     continue_final=True)
            except UserError as e:
                return f"{what}: the template refuses it{str(e).partition('refused the conversation')[2]}"
            theirs = theirs.removeprefix(self.bos_text)
            if theirs != ours:
                return f"{what}: ours ends {ours[-20:]!r}, the template's {theirs[-20:]!r}"
        return None

    def map_markers(self, text: str) -> str:
        return fc.map_markers(text, self.token_map)

    def _max_token_chars(self) -> int:
        """The longest token's spelling in characters (31 for Gemma): no token covers more characters of text."""
        if getattr(self, "_longest", None) is None:
            self._longest = max(map(len, self.tokenizer.get_vocab()), default=1)
        return self._longest

    def render(self, conv: dict, add_generation_prompt: bool = False, max_tokens: int | None = None,
               continue_final: bool = False) -> Rendered:
        """`max_tokens`: only the first that many tokens are needed (training's data.seq_len): a text far longer is
        tokenized only as far as they can reach (twice over: a cut word re-tokenizes only itself), so a 10 MB
        example no longer takes 20 s and 1.5 GB to be cut to 512 tokens; `partial` then says so.
        `continue_final`: a prompt whose last message is the start of an assistant answer (TRL's continue_final_message
        rows), left open as apply_chat_template(continue_final_message=True) leaves it, for the model to continue as
        training saw the start given (instead of `add_generation_prompt`)."""
        segs = [(self.map_markers(t), tr) for t, tr in self.segments(conv, add_generation_prompt, continue_final)]
        tail = False
        if not add_generation_prompt and not continue_final and self.loss_on == "assistant" and "text" not in conv:
            segs, tail = _drop_untrained_tail(segs)
        # BOS is added as an id; a template that writes it as text has it removed here
        if segs and self.bos_text and segs[0][0].startswith(self.bos_text):
            segs[0] = (segs[0][0][len(self.bos_text):], segs[0][1])
        text = "".join(t for t, _ in segs)
        partial = False
        if max_tokens is not None and len(text) > 2 * (max_tokens + 1) * self._max_token_chars() + 1024:
            head = text[:2 * (max_tokens + 1) * self._max_token_chars() + 1024]
            enc = self.tokenizer(head, add_special_tokens=False, return_offsets_mapping=True)
            partial = len(enc["input_ids"]) > max_tokens  # else a normaliser packed more text into a token: all of it
            text = head if partial else text
        if not partial:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray([self.bos_id] + list(enc["input_ids"]), np.int32)
        if self.vocab_size is not None and len(ids) and int(ids.max()) >= self.vocab_size:
            bad = int(ids.max())
            raise UserError(f"token id {bad} ({self.tokenizer.convert_ids_to_tokens(bad)!r}) is past the model's "
                            f"vocabulary (vocab_size {self.vocab_size} in its config.json): the tokenizer does not "
                            f"belong to this model")
        offsets = np.zeros((len(ids), 2), np.int32)
        if len(ids) > 1:
            offsets[1:] = np.asarray(enc["offset_mapping"], np.int32).reshape(-1, 2)
        if self.loss_on == "all":
            mask = np.ones(len(ids), bool)
        else:
            mask = np.zeros(len(ids), bool)
            mask[1:] = _overlaps(offsets[1:], _spans(segs, True))
        return Rendered(ids, mask, text, offsets, tail, partial, joined_at(segs, text, offsets))


# the parts `Renderer.prompt_parts` counts: given with the prompt (the system prompt, the tool declarations), then
# what its user wrote (the question) and what came after it (a chat's tool calls and results, a test conversation's
# later turns, the start of the answer a prompt gives: `Renderer.render`'s continue_final)
PROMPT_PARTS = ("the system prompt", "the tool declarations", "the question", "the turns after it",
                "the tool calls and results", "the start of the answer")


def _prompt_parts(renderer: Renderer, conv: dict, total: int,
                  max_tokens: int | None = None) -> list[tuple[str, int]] | None:
    """See `Renderer.prompt_parts`."""
    msgs, tools = conv.get("messages") or [], conv.get("tools") or []
    k = next((i for i, m in enumerate(msgs) if m.get("role") not in ("system", "developer")), len(msgs))
    if k == len(msgs) or msgs[k].get("role") != "user" or (k == 0 and not tools):
        return None

    def size(messages: list, declared: list) -> int:
        r = renderer.render({"tools": declared, "messages": messages}, add_generation_prompt=True,
                            max_tokens=max_tokens)
        return len(r.ids) if not r.partial else -1

    try:  # the system prompt is counted apart from the declarations: a format may fold it into the user turn
        question, untooled = size(msgs[k:k + 1], []), size(msgs[:k + 1], [])
        first = size(msgs[:k + 1], tools) if tools else untooled
    except Exception:  # noqa: BLE001 - a template refusing a part alone: the error it serves goes without the parts
        return None
    if min(question, untooled, first) < 0:
        return None
    parts = [(PROMPT_PARTS[0], untooled - question), (PROMPT_PARTS[1], first - untooled)]
    parts = [p for p in parts if p[1] > 0]
    if k + 1 < len(msgs):
        after = msgs[k + 1:]
        if len(after) == 1 and after[0].get("role") == "assistant" and not after[0].get("tool_calls"):
            name = PROMPT_PARTS[5]  # a text answer's start, continued (it was named the tool calls and results)
        else:
            name = PROMPT_PARTS[4 if all(m.get("role") in ("assistant", "tool") for m in after) else 3]
        parts += [(PROMPT_PARTS[2], question), (name, total - first)]
    else:
        parts.append((PROMPT_PARTS[2], total - first + question))
    return parts if parts[0][0] != PROMPT_PARTS[2] and all(n >= 0 for _, n in parts) else None


def _spans(segs: list[tuple[str, bool]], trainable: bool) -> np.ndarray:
    """The character spans [start, end) of the non-empty segments marked `trainable`, in order: int64 [k, 2]."""
    bounds = np.cumsum([0] + [len(t) for t, _ in segs])
    keep = [i for i, (t, tr) in enumerate(segs) if tr == trainable and t]
    return np.stack([bounds[keep], bounds[np.asarray(keep, int) + 1]], axis=1) if keep else np.zeros((0, 2), int)


def _overlaps(offsets: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """Whether each token (its character span; an empty one counts its first character) shares a character with one
    of `spans` (in order, disjoint). One search a token: a pass over every token for each span was quadratic in a
    chat's turns (a 4,000-turn chat spent longer on its mask than on its tokenization)."""
    starts, ends = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)
    if not len(spans):
        return np.zeros(len(offsets), bool)
    k = np.searchsorted(spans[:, 1], starts, side="right")  # the first span ending after the token starts
    return (k < len(spans)) & (spans[np.minimum(k, len(spans) - 1), 0] < ends)


def joined_at(segs: list[tuple[str, bool]], text: str, offsets: np.ndarray) -> str | None:
    """The first token that spans the start of a trained span after untrained text (the place a served model starts
    generating), as its text; None where every such start is a token's start. Tokenized with the prompt, an answer
    opening with newlines shares one token with the turn's own newline (Gemma's '\n\n\n'); a server tokenizes the
    prompt apart and the model generates after the prompt's last token, so that token is trained where it is never
    served."""
    starts, ends = offsets[1:, 0], offsets[1:, 1]
    pos, before, opens = 0, False, []  # the starts of trained text after untrained text
    for t, trainable in segs:
        if trainable and t and before and pos:
            opens.append(pos)
        if t:
            before = not trainable
        pos += len(t)
    if not opens or not len(starts):
        return None
    k = np.searchsorted(opens, starts, side="right")  # the first such start after each token's start
    at = np.asarray(opens + [pos + 1])[k]
    hit = np.flatnonzero(at < ends)  # tokens spanning a start: the first start's first token
    if not len(hit):
        return None
    first = hit[np.lexsort((hit, at[hit]))[0]]
    return text[starts[first]:ends[first]]


def _drop_untrained_tail(segs: list[tuple[str, bool]]) -> tuple[list[tuple[str, bool]], bool]:
    """Segments up to the last trained one and the whitespace that closes its turn: the turns after it (a chat
    ending in a user turn, an untrained answer, a tool result) train nothing and change no loss (attention is
    causal), but took row space and made an example over-length. True when something was left out."""
    last = max((i for i, (t, tr) in enumerate(segs) if tr and t), default=None)
    if last is None:
        return segs, False
    rest = "".join(t for t, _ in segs[last + 1:])
    keep = rest[:len(rest) - len(rest.lstrip())]
    if keep == rest:
        return segs, False
    return segs[:last + 1] + ([(keep, False)] if keep else []), True
