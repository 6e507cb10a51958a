"use strict";
// My approvals: the signed-in person's live grants, each with a revoke button.

const { call, errorOf, when } = window.approvalChat;
const SCOPE_TEXT = { session: "This session", always: "Always" };

function cell(row, text) {
  const td = document.createElement("td");
  td.textContent = text;
  row.appendChild(td);
  return td;
}

function render(grants) {
  const rows = document.getElementById("grant-rows");
  rows.replaceChildren();
  document.getElementById("grants").hidden = grants.length === 0;
  document.getElementById("no-grants").hidden = grants.length !== 0;
  for (const grant of grants) {
    const row = document.createElement("tr");
    row.dataset.grantId = grant.id;
    row.dataset.tool = grant.tool;
    row.dataset.scope = grant.scope;
    const name = document.createElement("code");
    name.textContent = grant.tool;
    row.appendChild(document.createElement("td")).appendChild(name);
    let scope = SCOPE_TEXT[grant.scope] || grant.scope;
    if (grant.scope === "session") {
      scope += grant.in_this_chat ? " (your current chat)" : " (another chat)";
    }
    cell(row, scope);
    cell(row, grant.bound_to_arguments ? "only the approved arguments" : "any");
    cell(row, when(grant.created_at));
    cell(row, when(grant.expires_at));
    const button = document.createElement("button");
    button.type = "button";
    button.className = "revoke";
    button.textContent = "Revoke";
    button.setAttribute("aria-label", `Revoke the grant for ${grant.tool} (${scope})`);
    button.addEventListener("click", () => revoke(grant, button));
    row.appendChild(document.createElement("td")).appendChild(button);
    rows.appendChild(row);
  }
}

async function load() {
  const status = document.getElementById("status");
  const response = await call("/api/grants");
  if (!response.ok) {
    status.textContent = "Could not load your grants: " + await errorOf(response);
    return;
  }
  const body = await response.json();
  render(body.grants);
  status.textContent = body.grants.length === 1 ? "You hold 1 grant." :
    `You hold ${body.grants.length} grants.`;
}

async function revoke(grant, button) {
  const status = document.getElementById("status");
  button.disabled = true;
  const response = await call(`/api/grants/${encodeURIComponent(grant.id)}/revoke`, {});
  if (!response.ok) {
    status.textContent = "Not revoked: " + await errorOf(response);
    button.disabled = false;
    return;
  }
  await load();
  status.textContent = `Revoked. The next ${grant.tool} call asks you again.`;
  document.getElementById("reload").focus();
}

document.getElementById("reload").addEventListener("click", load);
load();
