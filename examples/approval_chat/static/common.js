"use strict";
// What every signed-in page shares: JSON calls to the app, and signing out.

window.approvalChat = {
  /** POST (or GET without a body) JSON to the app; a lapsed sign-in goes back to /sign-in. */
  async call(path, body) {
    const init = body === undefined ? {} : {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    };
    const response = await fetch(path, init);
    if (response.status === 401) {
      window.location.assign("/sign-in");
      throw new Error("signed out");
    }
    return response;
  },

  /** The message of an app error response. */
  async errorOf(response) {
    const body = await response.json().catch(() => ({}));
    return (body.error && body.error.message) || ("the app answered " + response.status);
  },

  /** A Unix time as a short local date and time. */
  when(seconds) {
    if (seconds === null || seconds === undefined) return "never";
    const date = new Date(seconds * 1000);
    const pad = (n) => String(n).padStart(2, "0");
    return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ` +
      `${pad(date.getHours())}:${pad(date.getMinutes())}`;
  },
};

document.getElementById("sign-out").addEventListener("click", async () => {
  await fetch("/api/sign-out", { method: "POST", headers: { "Content-Type": "application/json" },
    body: "{}" });
  window.location.assign("/sign-in");
});
