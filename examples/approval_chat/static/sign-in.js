"use strict";
// The sign-in page: posts the API key to the app, which checks it with the model server.

document.getElementById("sign-in-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const error = document.getElementById("sign-in-error");
  error.textContent = "";
  const key = document.getElementById("api-key").value.trim();
  if (!key) {
    error.textContent = "Enter your API key.";
    return;
  }
  const response = await fetch("/api/sign-in", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ api_key: key }),
  });
  if (response.ok) {
    window.location.assign("/");
    return;
  }
  const body = await response.json().catch(() => ({}));
  error.textContent = "Not signed in: " + ((body.error && body.error.message) || response.status);
});
