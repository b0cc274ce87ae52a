"""A local stand-in for the Hugging Face Hub HTTP API, on 127.0.0.1, for the real client.

Speaks the subset ``huggingface_hub`` uses for create_repo, create_branch, create_commit
(preupload, LFS batch + basic upload + verify, ndjson commit), list_repo_files /
list_repo_tree, repo_info, and file resolve (HEAD/GET with X-Repo-Commit, ETag,
Content-Length, Range). Plain LFS only: set HF_HUB_DISABLE_XET=1 in the client.
State lives in memory; ``fail_next_resolve`` lets a test corrupt one download.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse


class Repo:
    def __init__(self):
        self.commits: dict[str, dict[str, dict]] = {}  # sha -> {path: {"data"| "lfs"}}
        self.branches: dict[str, str] = {}
        self.log: list[dict] = []


class FakeHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.requests: list[str] = []
        self.corrupt_next: set[str] = set()  # paths whose next GET returns flipped bytes
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *a):
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------ state helpers
    def files(self, repo: str, rev: str = "main") -> dict[str, dict]:
        r = self.repos[repo]
        return r.commits[r.branches.get(rev, rev)]

    def content(self, entry: dict) -> bytes:
        return self.lfs[entry["lfs"]] if "lfs" in entry else entry["data"]

    def _handler(hub):
        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code, body=b"", headers=None, ctype="application/json"):
                if isinstance(body, (dict, list)):
                    body = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _err(self, code, msg):
                self._send(code, {"error": msg}, {"X-Error-Message": msg})

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _route(self, method):
                u = urlparse(self.path)
                path, q = unquote(u.path), parse_qs(u.query)
                hub.requests.append(f"{method} {path}")
                body = self._body() if method in ("POST", "PUT") else b""
                m = re.fullmatch(r"/api/repos/create", path)
                if m and method == "POST":
                    d = json.loads(body)
                    rid = f"{d['organization']}/{d['name']}" if d.get("organization") else d["name"]
                    if rid not in hub.repos:
                        r = hub.repos[rid] = Repo()
                        sha = hashlib.sha1(rid.encode()).hexdigest()
                        r.commits[sha] = {".gitattributes": {"data": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"}}
                        r.branches["main"] = sha
                    return self._send(200, {"url": f"{hub.url}/{rid}", "name": rid, "id": rid})
                if path == "/api/validate-yaml" and method == "POST":  # create_commit checks README.md's YAML
                    import yaml
                    content = json.loads(body)["content"]
                    try:
                        head = content.split("---")[1] if content.startswith("---") else ""
                        ok = isinstance(yaml.safe_load(head) or {}, dict)
                    except (yaml.YAMLError, IndexError):
                        ok = False
                    return self._send(200 if ok else 400, {"errors": [] if ok else [{"message": "invalid YAML"}], "warnings": []})
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit|branch)/(.+)", path)
                if m and method == "POST":
                    rid, op, rev = m.groups()
                    if rid not in hub.repos:
                        return self._err(404, "Repository not found")
                    return getattr(self, f"_{op}")(hub.repos[rid], rid, rev, body)
                m = re.fullmatch(r"/([^/]+/[^/]+)\.git/info/lfs/objects/batch", path)
                if m and method == "POST":
                    d = json.loads(body)
                    objs = []
                    for o in d["objects"]:
                        e = {"oid": o["oid"], "size": o["size"], "authenticated": True}
                        if o["oid"] not in hub.lfs:
                            e["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"},
                                            "verify": {"href": f"{hub.url}/lfs-verify/{o['oid']}"}}
                        objs.append(e)
                    return self._send(200, {"transfer": "basic", "objects": objs})
                m = re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", path)
                if m and method == "PUT":
                    if hashlib.sha256(body).hexdigest() != m.group(1):
                        return self._err(400, "sha256 mismatch")
                    hub.lfs[m.group(1)] = body
                    return self._send(200, b"")
                m = re.fullmatch(r"/lfs-verify/([0-9a-f]{64})", path)
                if m and method == "POST":
                    return self._send(200 if m.group(1) in hub.lfs else 404, {})
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
                if m and method == "GET":
                    rid = m.group(1)
                    sha = self._resolve(rid, m.group(2) or "main")
                    if sha is None:
                        return None
                    return self._send(200, {"id": rid, "modelId": rid, "sha": sha, "private": False,
                                            "siblings": [{"rfilename": p} for p in sorted(hub.repos[rid].commits[sha])]})
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path)
                if m and method == "GET":
                    rid, sub = m.group(1), (m.group(3) or "").strip("/")
                    sha = self._resolve(rid, m.group(2))
                    if sha is None:
                        return None
                    r = hub.repos[rid]
                    out, dirs = [], set()
                    recursive = q.get("recursive", ["False"])[0].lower() == "true"
                    for p, e in sorted(r.commits[sha].items()):
                        if sub and not p.startswith(sub + "/"):
                            continue
                        rest = p[len(sub) + 1:] if sub else p
                        if "/" in rest and not recursive:
                            dirs.add((sub + "/" if sub else "") + rest.split("/")[0])
                            continue
                        data = hub.content(e)
                        ent = {"type": "file", "path": p, "size": len(data),
                               "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
                        if "lfs" in e:
                            ent["lfs"] = {"oid": e["lfs"], "size": len(data), "pointerSize": 134}
                        out.append(ent)
                    out += [{"type": "directory", "path": d, "oid": "0" * 40, "size": 0} for d in sorted(dirs)]
                    return self._send(200, out)
                m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if m and method in ("GET", "HEAD"):
                    rid, rev, fpath = m.groups()
                    sha = self._resolve(rid, rev)
                    if sha is None:
                        return None
                    files = hub.repos[rid].commits[sha]
                    if fpath not in files:
                        return self._send(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
                    e = files[fpath]
                    data = hub.content(e)
                    etag = e["lfs"] if "lfs" in e else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
                    if method == "GET" and fpath in hub.corrupt_next:
                        hub.corrupt_next.discard(fpath)
                        data = bytes([data[0] ^ 0xFF]) + data[1:]
                    headers = {"X-Repo-Commit": sha, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
                    rng = self.headers.get("Range")
                    if rng and method == "GET":
                        start = int(rng.split("=")[1].split("-")[0])
                        return self._send(206, data[start:], {**headers, "Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"},
                                          "application/octet-stream")
                    return self._send(200, data, headers, "application/octet-stream")
                return self._err(404, f"no route for {method} {path}")

            def _resolve(self, rid, rev):
                """Commit sha of rid@rev, or None after answering 404."""
                if rid not in hub.repos:
                    self._err(404, "Repository not found")
                    return None
                r = hub.repos[rid]
                sha = r.branches.get(rev, rev)
                if sha not in r.commits:
                    self._send(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
                    return None
                return sha

            def _preupload(self, repo, rid, rev, body):
                d = json.loads(body)
                return self._send(200, {"files": [{"path": f["path"], "uploadMode": "lfs" if f["size"] > 4096 else "regular",
                                                   "shouldIgnore": False, "oid": None} for f in d["files"]]})

            def _branch(self, repo, rid, rev, body):
                if rev in repo.branches:
                    return self._send(409, {"error": "Reference already exists"})
                repo.branches[rev] = repo.branches["main"]
                return self._send(200, {})

            def _commit(self, repo, rid, rev, body):
                if rev not in repo.branches:
                    return self._send(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
                files = dict(repo.commits[repo.branches[rev]])
                header = None
                for line in body.splitlines():
                    item = json.loads(line)
                    k, v = item["key"], item["value"]
                    if k == "header":
                        header = v
                    elif k == "file":
                        files[v["path"]] = {"data": base64.b64decode(v["content"])}
                    elif k == "lfsFile":
                        if v["oid"] not in hub.lfs:
                            return self._err(400, f"LFS object {v['oid']} was not uploaded")
                        files[v["path"]] = {"lfs": v["oid"]}
                    elif k == "deletedFile":
                        files.pop(v["path"], None)
                sha = hashlib.sha1(json.dumps([repo.branches[rev], sorted(files), header], default=str).encode()).hexdigest()
                repo.commits[sha] = files
                repo.branches[rev] = sha
                repo.log.append({"sha": sha, "branch": rev, "summary": (header or {}).get("summary")})
                return self._send(200, {"commitUrl": f"{hub.url}/{rid}/commit/{sha}", "commitOid": sha, "pullRequestUrl": None})

            def do_GET(self):
                self._route("GET")

            def do_HEAD(self):
                self._route("HEAD")

            def do_POST(self):
                self._route("POST")

            def do_PUT(self):
                self._route("PUT")

        return H
