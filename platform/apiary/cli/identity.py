"""``apiary login``, ``whoami``, ``user``, ``group`` and ``token``: identity from the command line.

The CLI's credential is ``APIARY_TOKEN``, else the file ``APIARY_HOME/token`` (mode 0600), which
``apiary login`` writes and ``apiary up`` fills with the first admin's token. Managing users and
groups needs an admin's token; anyone manages their own tokens.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from apiary.errors import ApiaryError

console = Console()


def _when(ts: float | None) -> str:
    return "-" if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC")


def add_identity_commands(app: typer.Typer, client: Callable[..., Any], fail: Callable[[ApiaryError], None]) -> None:
    """Add the identity commands to ``app``; ``client(token=None)`` makes an API client."""
    user_app = typer.Typer(no_args_is_help=True, help="Users (admins only).")
    group_app = typer.Typer(no_args_is_help=True, help="Groups and the virtual clusters they grant (admins only).")
    token_app = typer.Typer(no_args_is_help=True, help="Personal access tokens.")
    app.add_typer(user_app, name="user")
    app.add_typer(group_app, name="group")
    app.add_typer(token_app, name="token")
    ssh_key_app = typer.Typer(no_args_is_help=True, help="SSH public keys on your account (the ssh runtime plugin).")
    user_app.add_typer(ssh_key_app, name="ssh-key")

    def call(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except ApiaryError as e:
            fail(e)

    @app.command("login")
    def login(token: str | None = typer.Option(
            None, "--token", help="The token; default: read from standard input (a prompt on a terminal).")) -> None:
        """Check a token against the platform and keep it in APIARY_HOME/token (mode 0600)."""
        from apiary.auth.bootstrap import write_secret
        from apiary.settings import Settings

        if token is None:
            token = typer.prompt("Token", hide_input=True) if sys.stdin.isatty() else sys.stdin.readline()
        token = token.strip()
        me = call(lambda: client(token).me())
        path = Settings().token_path
        write_secret(path, token)
        console.print(f"Logged in as {me['kind']} {me['name']}; token kept in {path}.", markup=False)

    @app.command("whoami")
    def whoami(as_json: bool = typer.Option(False, "--json")) -> None:
        """Who the CLI's token is: name, groups, the virtual clusters you may use."""
        me = call(lambda: client().me())
        if as_json:
            print(json.dumps(me, indent=2))
            return
        role = " (admin)" if me["admin"] else ""
        print(f"{me['kind']} {me['name']}{role}; groups: {', '.join(me['groups']) or '-'}; "
              f"virtual clusters: {', '.join(me['virtualClusters']) or '-'}; token {me['tokenId']} "
              f"expires {_when(me['expires'])}")

    @user_app.command("list")
    def user_list(as_json: bool = typer.Option(False, "--json")) -> None:
        """Every user with their groups and virtual clusters."""
        users = call(lambda: client().users())
        if as_json:
            print(json.dumps(users, indent=2))
            return
        table = Table("user", "groups", "virtual clusters", "admin")
        for u in users:
            table.add_row(u["name"], ", ".join(u["groups"]), ", ".join(u["virtualClusters"]),
                          "yes" if u["admin"] else "")
        console.print(table)

    @user_app.command("create")
    def user_create(name: str, group: list[str] = typer.Option(
            [], "--group", help="Group to join (repeat); default the 'default' group."),
            email: str | None = typer.Option(None)) -> None:
        """Create a user."""
        u = call(lambda: client().create_user(name, groups=group or None, email=email))
        print(f"created user {u['name']} in {', '.join(u['groups']) or 'no group'}")

    @user_app.command("delete")
    def user_delete(name: str) -> None:
        """Delete a user and revoke their tokens (their jobs stay)."""
        call(lambda: client().delete_user(name))
        print(f"deleted user {name}")

    @group_app.command("list")
    def group_list(as_json: bool = typer.Option(False, "--json")) -> None:
        """Every group: members and granted virtual clusters."""
        groups = call(lambda: client().groups())
        if as_json:
            print(json.dumps(groups, indent=2))
            return
        table = Table("group", "members", "virtual clusters", "admin")
        for g in groups:
            table.add_row(g["name"], ", ".join(g["members"]), ", ".join(g["virtualClusters"]),
                          "yes" if g["admin"] else "")
        console.print(table)

    @group_app.command("create")
    def group_create(name: str, vc: list[str] = typer.Option([], "--vc", help="Virtual cluster to grant (repeat)."),
                     admin: bool = typer.Option(False, "--admin", help="An admin group."),
                     description: str = typer.Option("")) -> None:
        """Create a group granting virtual clusters."""
        g = call(lambda: client().create_group(name, vc, admin=admin, description=description))
        print(f"created group {g['name']} granting {', '.join(g['virtualClusters']) or 'no virtual cluster'}")

    @group_app.command("delete")
    def group_delete(name: str) -> None:
        call(lambda: client().delete_group(name))
        print(f"deleted group {name}")

    @group_app.command("add-member")
    def add_member(group: str, user: str) -> None:
        call(lambda: client().set_member(group, user, True))
        print(f"{user} is in {group}")

    @group_app.command("remove-member")
    def remove_member(group: str, user: str) -> None:
        call(lambda: client().set_member(group, user, False))
        print(f"{user} left {group}")

    @group_app.command("grant")
    def grant(group: str, vc: str) -> None:
        """Let the group's members use virtual cluster VC."""
        call(lambda: client().set_grant(group, vc, True))
        print(f"{group} may use {vc}")

    @group_app.command("revoke")
    def revoke(group: str, vc: str) -> None:
        call(lambda: client().set_grant(group, vc, False))
        print(f"{group} may no longer use {vc}")

    def whose(user: str | None) -> str:
        return user or call(lambda: client().me())["name"]

    @ssh_key_app.command("add")
    def ssh_key_add(
        key: str = typer.Argument(..., help="A public key file (e.g. ~/.ssh/id_ed25519.pub), or '-' for stdin."),
        title: str | None = typer.Option(None, "--title", help="A name for the key; default: the file's name."),
        user: str | None = typer.Option(None, "--user", help="Another user's account (admins only)."),
    ) -> None:
        """Keep a public key on your account: tasks of your jobs with the ssh plugin let it in."""
        from pathlib import Path

        text = sys.stdin.read() if key == "-" else Path(key).expanduser().read_text()
        name = title or ("stdin" if key == "-" else Path(key).name.removesuffix(".pub"))
        k = call(lambda: client().add_ssh_key(whose(user), name, text.strip()))
        print(f"added SSH key {k['title']} ({k['fingerprint']})")

    @ssh_key_app.command("list")
    def ssh_key_list(user: str | None = typer.Option(None, "--user", help="Another user's (admins only)."),
                     as_json: bool = typer.Option(False, "--json")) -> None:
        """The public keys on your account."""
        keys = call(lambda: client().ssh_keys(whose(user)))
        if as_json:
            print(json.dumps(keys, indent=2))
            return
        table = Table("title", "type", "fingerprint", "added")
        for k in keys:
            table.add_row(k["title"], k["value"].split()[0], k["fingerprint"], _when(k["created"]))
        console.print(table)

    @ssh_key_app.command("remove")
    def ssh_key_remove(title: str, user: str | None = typer.Option(
            None, "--user", help="Another user's (admins only).")) -> None:
        """Remove a key: tasks launched from now on no longer let it in."""
        call(lambda: client().remove_ssh_key(whose(user), title))
        print(f"removed SSH key {title}")

    @token_app.command("create")
    def token_create(
        description: str = typer.Option("", "--description"),
        expires_days: float = typer.Option(90.0, "--expires-days", help="Lifetime in days."),
        user: str | None = typer.Option(None, "--user", help="For another user (admins only)."),
    ) -> None:
        """Create a personal token; prints it once (Apiary keeps only its hash)."""
        t = call(lambda: client().create_token(user, description=description, expires_in_s=expires_days * 86400))
        err = Console(stderr=True)
        err.print(f"token {t['id']} for {t['subject']}, expires {_when(t['expires'])}; it is shown once:",
                  markup=False)
        print(t["token"])

    @token_app.command("list")
    def token_list(as_json: bool = typer.Option(False, "--json")) -> None:
        """Your tokens (admins: all), never their secrets."""
        tokens = call(lambda: client().tokens())
        if as_json:
            print(json.dumps(tokens, indent=2))
            return
        table = Table("id", "kind", "subject", "description", "created", "expires", "revoked")
        for t in tokens:
            table.add_row(t["id"], t["kind"], t["subject"], t["description"], _when(t["created"]),
                          _when(t["expires"]), _when(t["revoked"]))
        console.print(table)

    @token_app.command("revoke")
    def token_revoke(token_id: str) -> None:
        """Revoke a token at once."""
        call(lambda: client().revoke_token(token_id))
        print(f"revoked token {token_id}")
