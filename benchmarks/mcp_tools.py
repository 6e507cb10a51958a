"""Tool catalogs shaped like what agents with many MCP servers send: the argument schemas of
common servers' tools (filesystem, git, GitHub, Slack, a SQL database, a browser, a knowledge-graph
memory, web fetch and search, maps, time, an issue tracker, Kubernetes), with nested objects, enums,
arrays of objects, optional fields with bounds and long descriptions. Written here from the shapes
those servers publish (no schema is copied or downloaded); a catalog larger than the templates
repeats them as further servers of the same kinds (``github_2__create_issue``), as agents that
connect several accounts of one service do.

    from mcp_tools import mcp_catalog
    tools = mcp_catalog(512)          # [{"type": "function", "function": {...}}, ...]
"""

from __future__ import annotations

from typing import Any

_PATH = {"type": "string", "description": "Absolute path of the file or folder, inside one of the "
         "folders the server was started with; relative paths are resolved against the first."}
_REPO = {"owner": {"type": "string", "description": "Account or organisation that owns the "
                   "repository (the part of its URL before the name)."},
         "repo": {"type": "string", "description": "Repository name, without the owner."}}
_PAGE = {"page": {"type": "integer", "minimum": 1, "description": "Page of results, from 1."},
         "perPage": {"type": "integer", "minimum": 1, "maximum": 100,
                     "description": "Results per page (at most 100)."}}


def _obj(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


#: (server, tool, description, parameters)
_TEMPLATES: list[tuple[str, str, str, dict[str, Any]]] = [
    ("filesystem", "read_text_file",
     "Read the complete contents of a file as text. Handles various text encodings and gives "
     "detailed error messages if the file cannot be read. Use head or tail to read only the first "
     "or last lines of a large file; only works within allowed directories.",
     _obj({"path": _PATH,
           "head": {"type": "integer", "minimum": 1, "description": "Only the first N lines."},
           "tail": {"type": "integer", "minimum": 1, "description": "Only the last N lines."}},
          ["path"])),
    ("filesystem", "edit_file",
     "Make line-based edits to a text file. Each edit replaces exact line sequences with new "
     "content. Returns a git-style diff showing the changes made; with dryRun the diff is shown "
     "and nothing is written.",
     _obj({"path": _PATH,
           "edits": {"type": "array", "minItems": 1, "items": _obj(
               {"oldText": {"type": "string", "description": "Text to search for: must match "
                            "exactly, whitespace included."},
                "newText": {"type": "string", "description": "Text to replace it with."}},
               ["oldText", "newText"])},
           "dryRun": {"type": "boolean", "default": False,
                      "description": "Preview the changes as a diff without writing them."}},
          ["path", "edits"])),
    ("filesystem", "search_files",
     "Recursively search for files and directories matching a glob pattern, from a starting "
     "path; matches are case-insensitive. Returns full paths. Great for finding files when you "
     "do not know their exact location.",
     _obj({"path": _PATH, "pattern": {"type": "string", "description": "Glob, e.g. **/*.py"},
           "excludePatterns": {"type": "array", "items": {"type": "string"}, "default": [],
                               "description": "Globs of paths to leave out."}},
          ["path", "pattern"])),
    ("git", "git_log",
     "Show the commit log of a repository: hash, author, date and message of each commit, newest "
     "first, optionally limited to a range of dates.",
     _obj({"repo_path": {"type": "string", "description": "Path to the Git repository."},
           "max_count": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 10},
           "start_timestamp": {"type": "string", "description": "ISO 8601 date or relative date "
                               "('2 weeks ago') of the oldest commit."},
           "end_timestamp": {"type": "string"}},
          ["repo_path"])),
    ("github", "create_issue",
     "Create a new issue in a GitHub repository. Labels and assignees must already exist in the "
     "repository; the milestone is given by number. Returns the created issue with its number "
     "and URL.",
     _obj({**_REPO, "title": {"type": "string", "minLength": 1},
           "body": {"type": "string", "description": "Markdown body of the issue."},
           "assignees": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
           "labels": {"type": "array", "items": {"type": "string"}},
           "milestone": {"type": "integer", "minimum": 1}},
          ["owner", "repo", "title"])),
    ("github", "create_pull_request",
     "Create a pull request from a branch. The head branch must contain commits not in the base "
     "branch. Draft pull requests cannot be merged until marked ready for review.",
     _obj({**_REPO, "title": {"type": "string"}, "body": {"type": "string"},
           "head": {"type": "string", "description": "Branch with your changes (owner:branch "
                    "for a fork)."},
           "base": {"type": "string", "description": "Branch to merge into."},
           "draft": {"type": "boolean"}, "maintainer_can_modify": {"type": "boolean"}},
          ["owner", "repo", "title", "head", "base"])),
    ("github", "search_code",
     "Search for code across GitHub repositories with GitHub's code search syntax (qualifiers "
     "such as repo:, language:, path:). Results are sorted by best match unless a sort is given.",
     _obj({"q": {"type": "string", "description": "Search query with qualifiers."},
           "sort": {"type": "string", "enum": ["indexed"]},
           "order": {"type": "string", "enum": ["asc", "desc"]}, **_PAGE},
          ["q"])),
    ("github", "update_pull_request_review",
     "Submit a review on a pull request, with comments attached to lines of the diff.",
     _obj({**_REPO, "pull_number": {"type": "integer", "minimum": 1},
           "event": {"type": "string", "enum": ["APPROVE", "REQUEST_CHANGES", "COMMENT"]},
           "body": {"type": "string"},
           "comments": {"type": "array", "items": _obj(
               {"path": {"type": "string"}, "line": {"type": "integer", "minimum": 1},
                "side": {"type": "string", "enum": ["LEFT", "RIGHT"]},
                "body": {"type": "string"}}, ["path", "body"])}},
          ["owner", "repo", "pull_number", "event"])),
    ("slack", "post_message",
     "Post a new message to a Slack channel, or reply in a thread when thread_ts is given. "
     "Messages are formatted with Slack's mrkdwn; blocks give richer layouts.",
     _obj({"channel_id": {"type": "string", "pattern": "^[CDG][A-Z0-9]{8,}$",
                          "description": "ID of the channel (not its name)."},
           "text": {"type": "string", "maxLength": 40000},
           "thread_ts": {"type": "string", "description": "Timestamp of the parent message."},
           "blocks": {"type": "array", "items": {"type": "object", "properties": {
               "type": {"type": "string", "enum": ["section", "divider", "context", "header"]},
               "text": _obj({"type": {"type": "string", "enum": ["mrkdwn", "plain_text"]},
                             "text": {"type": "string"}}, ["type", "text"])},
               "required": ["type"]}}},
          ["channel_id", "text"])),
    ("slack", "get_channel_history",
     "Get recent messages from a channel, newest first, up to a limit.",
     _obj({"channel_id": {"type": "string"},
           "limit": {"type": "integer", "minimum": 1, "maximum": 200, "default": 10}},
          ["channel_id"])),
    ("postgres", "query",
     "Run a read-only SQL query against the connected database. The query runs inside a READ "
     "ONLY transaction; statements that write are refused. Returns rows as JSON objects.",
     _obj({"sql": {"type": "string", "description": "One SQL statement."},
           "params": {"type": "array", "items": {"type": ["string", "number", "boolean", "null"]}},
           "row_limit": {"type": "integer", "minimum": 1, "maximum": 10000}},
          ["sql"])),
    ("browser", "navigate",
     "Navigate the browser to a URL and wait until the page has loaded. Launch options restart "
     "the browser with other settings (headless, viewport).",
     _obj({"url": {"type": "string", "format": "uri"},
           "waitUntil": {"type": "string", "enum": ["load", "domcontentloaded", "networkidle0",
                                                    "networkidle2"]},
           "launchOptions": {"type": "object", "properties": {
               "headless": {"type": "boolean"},
               "args": {"type": "array", "items": {"type": "string"}},
               "defaultViewport": _obj({"width": {"type": "integer", "minimum": 1},
                                        "height": {"type": "integer", "minimum": 1}},
                                       ["width", "height"])}}},
          ["url"])),
    ("browser", "screenshot",
     "Take a screenshot of the current page or of one element, stored under a name for later "
     "reference and returned as an image.",
     _obj({"name": {"type": "string"}, "selector": {"type": "string"},
           "width": {"type": "integer", "minimum": 1, "maximum": 4096, "default": 800},
           "height": {"type": "integer", "minimum": 1, "maximum": 4096, "default": 600},
           "encoded": {"type": "boolean"}},
          ["name"])),
    ("memory", "create_entities",
     "Create several new entities in the knowledge graph, each with a type and observations "
     "(facts about it). Entities that already exist are left as they are.",
     _obj({"entities": {"type": "array", "items": _obj(
         {"name": {"type": "string"}, "entityType": {"type": "string"},
          "observations": {"type": "array", "items": {"type": "string"}}},
         ["name", "entityType", "observations"])}}, ["entities"])),
    ("memory", "create_relations",
     "Create relations between entities of the knowledge graph, in active voice (from -> to).",
     _obj({"relations": {"type": "array", "items": _obj(
         {"from": {"type": "string"}, "to": {"type": "string"},
          "relationType": {"type": "string"}}, ["from", "to", "relationType"])}}, ["relations"])),
    ("fetch", "fetch",
     "Fetch a URL from the internet and return its contents as markdown (or raw HTML). Long pages "
     "are cut at max_length; call again with start_index to read on.",
     _obj({"url": {"type": "string", "format": "uri"},
           "max_length": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1000000,
                          "default": 5000},
           "start_index": {"type": "integer", "minimum": 0, "default": 0},
           "raw": {"type": "boolean", "default": False}},
          ["url"])),
    ("search", "web_search",
     "Search the web. Returns titles, URLs and snippets; use for general queries, news and "
     "recent events. At most 20 results per call; paginate with offset.",
     _obj({"query": {"type": "string", "maxLength": 400},
           "count": {"type": "integer", "minimum": 1, "maximum": 20, "default": 10},
           "offset": {"type": "integer", "minimum": 0, "maximum": 9},
           "freshness": {"type": "string", "enum": ["pd", "pw", "pm", "py"]},
           "safesearch": {"type": "string", "enum": ["off", "moderate", "strict"]}},
          ["query"])),
    ("maps", "directions",
     "Get directions between two places, with distance and duration of each step.",
     _obj({"origin": {"type": "string", "description": "Address or 'lat,lng'."},
           "destination": {"type": "string"},
           "mode": {"type": "string", "enum": ["driving", "walking", "bicycling", "transit"]},
           "waypoints": {"type": "array", "items": {"type": "string"}, "maxItems": 25},
           "avoid": {"type": "array", "items": {"type": "string",
                                                "enum": ["tolls", "highways", "ferries"]}}},
          ["origin", "destination"])),
    ("time", "convert_time",
     "Convert a time between time zones (IANA names such as 'Europe/Paris').",
     _obj({"source_timezone": {"type": "string"},
           "time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$",
                    "description": "Time in 24-hour format (HH:MM)."},
           "target_timezone": {"type": "string"}},
          ["source_timezone", "time", "target_timezone"])),
    ("tracker", "create_ticket",
     "Create a ticket in the issue tracker. Custom fields depend on the project; the priority "
     "and the issue type must be among the project's.",
     _obj({"project": {"type": "string"}, "summary": {"type": "string", "maxLength": 255},
           "description": {"type": "string"},
           "issue_type": {"type": "string", "enum": ["Bug", "Task", "Story", "Epic"]},
           "priority": {"type": "string", "enum": ["Highest", "High", "Medium", "Low", "Lowest"]},
           "fields": {"type": "object", "properties": {
               "components": {"type": "array", "items": _obj({"name": {"type": "string"}}, ["name"])},
               "story_points": {"type": "number", "minimum": 0},
               "due_date": {"type": "string", "format": "date"}}},
           "parent": {"type": "string", "description": "Key of the parent epic."}},
          ["project", "summary", "issue_type"])),
    ("kubernetes", "scale_deployment",
     "Scale a deployment to a number of replicas; with wait, return once the rollout finished.",
     _obj({"name": {"type": "string"}, "namespace": {"type": "string", "default": "default"},
           "replicas": {"type": "integer", "minimum": 0, "maximum": 1000},
           "wait": {"type": "boolean"},
           "timeout_seconds": {"type": "integer", "minimum": 1, "maximum": 3600}},
          ["name", "replicas"])),
]


def mcp_catalog(count: int) -> list[dict[str, Any]]:
    """``count`` chat-completions tools, the templates in turn, further rounds as further servers."""
    tools = []
    for index in range(count):
        server, tool, description, parameters = _TEMPLATES[index % len(_TEMPLATES)]
        round_ = index // len(_TEMPLATES)
        prefix = server if round_ == 0 else f"{server}_{round_ + 1}"
        tools.append({"type": "function", "function": {
            "name": f"{prefix}__{tool}", "description": description, "parameters": parameters,
            "strict": True}})
    return tools


def template_count() -> int:
    return len(_TEMPLATES)
