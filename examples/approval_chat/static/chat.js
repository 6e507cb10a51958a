"use strict";
// The chat page: renders the app's event stream and asks the person about every elicitation.
// Answers are held here until every pending approval has one (then they are sent at once), or
// until the person presses "Send my answers now": the approvals proposal's rule for clients.

const { call, errorOf, when } = window.approvalChat;
const $ = (id) => document.getElementById(id);

/** elicitation id -> {view, card, choice: {action, scope} | null} while it waits for an answer */
const pending = new Map();
let streamingText = null;   // the assistant message being streamed, if any
let working = false;

// ------------------------------------------------------------------------------ rendering

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function entry(kind, who) {
  const li = el("li", "entry " + kind);
  li.appendChild(el("p", "who", who));
  $("transcript").appendChild(li);
  return li;
}

function argumentsList(args) {
  if (typeof args !== "object" || args === null) {
    return el("pre", "raw-arguments", String(args));
  }
  const keys = Object.keys(args);
  if (keys.length === 0) return el("p", "arguments-none", "no arguments");
  const dl = el("dl", "arguments");
  for (const key of keys) {
    dl.appendChild(el("dt", "", key));
    const value = args[key];
    dl.appendChild(el("dd", "", typeof value === "string" ? value : JSON.stringify(value)));
  }
  return dl;
}

function toolName(view) {
  return view.namespace ? `${view.namespace}__${view.name}` : view.name;
}

const render = {
  user(view) { entry("user", "You").appendChild(el("p", "text", view.text)); },

  assistant(view) {
    const li = streamingText || entry("assistant", "Assistant");
    streamingText = null;
    li.classList.remove("streaming");
    let text = li.querySelector(".text");
    if (!text) text = li.appendChild(el("p", "text"));
    text.textContent = view.text || "(the model answered with no text)";
  },

  call(view) {
    const li = entry("call", "The assistant calls ");
    li.querySelector(".who").appendChild(el("code", "", view.name));
    li.dataset.callId = view.call_id;
    li.appendChild(argumentsList(view.arguments));
    if (view.released) {
      li.dataset.released = view.released.scope || view.released.via;
      li.appendChild(el("p", "released " + view.released.via, view.released.text));
    }
  },

  turn(view) {
    const li = entry("turn", "Tools this turn");
    li.dataset.allowed = view.tools.map((t) => t.name).join(" ");
    li.dataset.gated = view.gated.join(" ");
    if (view.tools.length === 0) {
      li.appendChild(el("p", "help", "None: the assistant answers in words and calls nothing."));
      return;
    }
    li.appendChild(el("p", "help", view.mode === "required"
      ? "The assistant must call one of these, and nothing else:"
      : "The assistant may call these, and nothing else:"));
    const list = el("ul", "turn-tools");
    for (const tool of view.tools) {
      const item = el("li", "gate-" + tool.gate);
      item.dataset.tool = tool.name;
      item.appendChild(el("code", "", tool.name));
      item.appendChild(document.createTextNode(" — " + GATES[tool.gate]));
      list.appendChild(item);
    }
    li.appendChild(list);
  },

  result(view) {
    const li = entry("result", "Result of ");
    li.querySelector(".who").appendChild(el("code", "", view.name || "a call"));
    li.dataset.callId = view.call_id;
    li.appendChild(el("pre", "output", view.output));
  },

  approval(view) { approvalCard(view); },

  answer(view) {
    const known = pending.get(view.elicitation_id);
    const card = known ? known.card : document.querySelector(
      `.approval[data-elicitation-id="${CSS.escape(view.elicitation_id)}"]`);
    pending.delete(view.elicitation_id);
    if (card) closeCard(card, describeAnswer(view, card.optionsByKey));
  },
};

/** what each tool state means for the person (turn_notes.turn_note's ``gate``) */
const GATES = {
  asks: "asks for your approval first",
  session: "gated; your session grant lets it run without asking",
  always: "gated; your standing grant lets it run without asking",
  free: "runs without asking",
  unknown: "the server's policy decides whether it asks",
};

function optionKey(action, scope) { return scope ? `${action}:${scope}` : action; }

function describeAnswer(answer, optionsByKey) {
  const option = optionsByKey && optionsByKey.get(optionKey(answer.action, answer.scope));
  let text = "You answered: " + (option ? option.label : answer.action);
  if (answer.reason) text += ` (reason: ${answer.reason})`;
  return text;
}

function approvalCard(view) {
  const tool = toolName(view);
  const card = el("li", "entry approval");
  card.dataset.elicitationId = view.id;
  card.dataset.tool = tool;
  const headingId = `approval-${view.id}`;
  card.setAttribute("aria-labelledby", headingId);
  const heading = el("h3", "", "Approval needed: ");
  heading.id = headingId;
  heading.tabIndex = -1;
  heading.appendChild(el("code", "", tool));
  card.appendChild(heading);
  card.appendChild(el("p", "server-message", view.message));
  card.appendChild(el("p", "label", "It would be called with:"));
  card.appendChild(argumentsList(view.arguments));
  if (view.expires_at) {
    card.appendChild(el("p", "help", "Answer by " + when(view.expires_at) +
      "; after that the call is declined."));
  }
  card.optionsByKey = new Map(view.options.map((o) => [optionKey(o.action, o.scope), o]));

  const fieldset = el("fieldset", "choices");
  fieldset.appendChild(el("legend", "", "Your answer"));
  for (const option of view.options) {
    const row = el("div", "choice");
    const button = el("button", "choice-button", option.label);
    button.type = "button";
    button.dataset.action = option.action;
    if (option.scope) button.dataset.scope = option.scope;
    const meaningId = `${view.id}-${optionKey(option.action, option.scope)}`;
    button.setAttribute("aria-describedby", meaningId);
    button.setAttribute("aria-pressed", "false");
    button.addEventListener("click", () => choose(view.id, option));
    const meaning = el("p", "meaning", option.meaning);
    meaning.id = meaningId;
    if (option.action === "decline") {   // the reason comes first: Decline sends what it holds
      const reasonId = `${view.id}-reason`;
      const label = el("label", "", "Why decline? (optional; the assistant reads it)");
      label.htmlFor = reasonId;
      const reason = el("input", "reason");
      reason.id = reasonId;
      reason.type = "text";
      reason.addEventListener("keydown", (event) => {   // Enter in the reason declines
        if (event.key === "Enter") {
          event.preventDefault();
          choose(view.id, option);
        }
      });
      row.classList.add("decline");
      row.append(label, reason);
    }
    row.append(button, meaning);
    fieldset.appendChild(row);
  }
  card.appendChild(fieldset);
  card.appendChild(el("p", "answer-state", "Not answered yet."));
  $("transcript").appendChild(card);

  if (view.state === "pending") {
    pending.set(view.id, { view, card, choice: null });
  } else if (view.state === "answered") {
    closeCard(card, describeAnswer(view.answer, card.optionsByKey));
  } else {
    closeCard(card, "Not answered: the server declined this call when the answers were sent.");
  }
}

function closeCard(card, text) {
  for (const control of card.querySelectorAll("button, input")) control.disabled = true;
  card.querySelector(".choices").hidden = true;   // answered: only what was chosen stays
  card.classList.add("closed");
  card.querySelector(".answer-state").textContent = text;
}

function renderDesk(desk) {
  for (const [name, entries] of Object.entries(desk)) {
    const list = $("desk-" + name);
    if (!list) continue;
    list.replaceChildren(...entries.map((text) => el("li", "", text)));
    if (entries.length === 0) list.appendChild(el("li", "empty", "nothing yet"));
  }
}

// ---------------------------------------------------------------------- answers and sending

function choose(id, option) {
  const waiting = pending.get(id);
  if (!waiting || working) return;
  waiting.choice = { action: option.action, scope: option.scope };
  for (const button of waiting.card.querySelectorAll(".choice-button")) {
    const same = button.dataset.action === option.action &&
      (button.dataset.scope || null) === (option.scope || null);
    button.setAttribute("aria-pressed", same ? "true" : "false");
  }
  waiting.card.querySelector(".answer-state").textContent =
    `Your answer: ${option.label} (not sent yet; you may still change it).`;
  const open = [...pending.values()].filter((p) => p.choice === null);
  if (open.length === 0) {
    sendAnswers(false);
    return;
  }
  updateApprovalBar();
  focusPrompt(open[0].card);
}

/** Focus a prompt's heading and scroll its answer buttons into view (focus alone shows only the
 * heading; the buttons may be below the fold). */
function focusPrompt(card) {
  card.querySelector("h3").focus({ preventScroll: true });
  card.querySelector(".choices").scrollIntoView({ block: "end", inline: "nearest" });
  const heading = card.querySelector("h3").getBoundingClientRect();
  if (heading.top < 0 && card.getBoundingClientRect().height <= window.innerHeight) {
    card.scrollIntoView({ block: "start" });
  }
}

function updateApprovalBar() {
  const waiting = [...pending.values()];
  const answered = waiting.filter((p) => p.choice !== null).length;
  $("approval-bar").hidden = waiting.length === 0 || working;
  $("approval-count").textContent = waiting.length === 1
    ? "1 approval request waits for your answer."
    : `${answered} of ${waiting.length} approval requests answered. They are sent when all are ` +
      "answered.";
  const locked = waiting.length > 0 || working;
  $("message").disabled = locked;
  $("send").disabled = locked;
  $("new-chat").disabled = working;
  $("message").placeholder = waiting.length > 0
    ? "Answer the approval requests above first." : "";
}

function sendAnswers(submitNow) {
  const answers = [...pending.entries()]
    .filter(([, p]) => p.choice !== null)
    .map(([id, p]) => {
      const reason = p.card.querySelector("input.reason");   // read when sent: typed after is fine
      return { elicitation_id: id, ...p.choice,
        reason: p.choice.action === "decline" && reason ? reason.value.trim() : null };
    });
  for (const [id, waiting] of pending) {
    for (const control of waiting.card.querySelectorAll("button, input")) control.disabled = true;
    if (waiting.choice === null) {   // submitted without it: the server declines it
      closeCard(waiting.card, "Not answered: the server declined this call when the answers " +
        "were sent.");
      pending.delete(id);
    }
  }
  return run("/api/chat/answers", { answers, submit_now: submitNow });
}

// ------------------------------------------------------------------------------ the stream

function handle(event) {
  switch (event.type) {
    case "item":
      if (event.item && render[event.item.kind]) render[event.item.kind](event.item);
      break;
    case "text_delta":
      if (!streamingText) {
        streamingText = entry("assistant streaming", "Assistant");
        streamingText.appendChild(el("p", "text", ""));
      }
      streamingText.querySelector(".text").textContent += event.delta;
      break;
    case "desk":
      renderDesk(event.desk);
      break;
    case "waiting":
      say(event.pending.length === 1 ? "An approval request waits for your answer."
        : `${event.pending.length} approval requests wait for your answers.`);
      return "waiting";
    case "error":
      say("Error: " + event.message);
      return "error";
    case "done":
      say("The assistant has answered.");
      return "done";
  }
  return null;
}

function say(text) { $("status").textContent = text; }

async function run(path, body) {
  working = true;
  updateApprovalBar();
  say("The assistant is working…");
  let ending = null;
  try {
    const response = await call(path, body);
    if (!response.ok) {
      say("Not sent: " + await errorOf(response));
      ending = "error";
    } else {
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let newline;
        while ((newline = buffer.indexOf("\n")) >= 0) {
          const line = buffer.slice(0, newline);
          buffer = buffer.slice(newline + 1);
          if (line.trim()) ending = handle(JSON.parse(line)) || ending;
        }
      }
    }
  } catch (error) {
    say("The app could not be reached: " + error.message);
    ending = "error";
  }
  working = false;
  if (ending === "error" || ending === null) {
    const message = $("status").textContent;
    await reload();   // the app's record is the truth: redraw from it, keep the message
    say(message);
  }
  updateApprovalBar();
  if (pending.size > 0) {
    const first = [...pending.values()].find((p) => p.choice === null) || [...pending.values()][0];
    focusPrompt(first.card);
  } else {
    $("message").focus();
  }
  document.body.dataset.state = pending.size > 0 ? "waiting" : "idle";
}

async function reload() {
  const response = await call("/api/chat");
  if (!response.ok) return;
  const state = await response.json();
  pending.clear();
  streamingText = null;
  $("transcript").replaceChildren();
  for (const item of state.items) {
    if (render[item.kind]) render[item.kind](item);
  }
  renderDesk(state.desk);
  updateApprovalBar();
  document.body.dataset.state = pending.size > 0 ? "waiting" : "idle";
}

// ------------------------------------------------------------------------------ the composer

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("message").value.trim();
  if (!text || working || pending.size > 0) return;
  $("message").value = "";
  document.body.dataset.state = "working";
  run("/api/chat/messages", { text });
});

$("message").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

$("submit-now").addEventListener("click", () => {
  if (!working && pending.size > 0) {
    document.body.dataset.state = "working";
    sendAnswers(true);
  }
});

$("new-chat").addEventListener("click", async () => {
  const response = await call("/api/chat/new", {});
  if (!response.ok) {
    say("No new chat: " + await errorOf(response));
    return;
  }
  await reload();
  say("A new chat (a new session) has started.");
  $("message").focus();
});

reload().then(() => $("message").focus());
