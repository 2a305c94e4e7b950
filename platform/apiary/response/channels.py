"""Notification channels for incidents, and their delivery with retries and fallback (AI-System 7.6.2).

A page reaches a person over one of four channels (the names :mod:`apiary.oncall.routing` routes
to): ``email`` (SMTP), ``im`` (a Slack or Teams incoming webhook), ``sms`` and ``phone`` (a
provider's HTTP API in Twilio's shape). :class:`Dispatcher` tries the channels that
:meth:`apiary.oncall.routing.Routing.route` returns, in order:

1. A channel is tried up to ``attempts`` times, sleeping ``backoff_s`` between tries, while it
   fails with :class:`~apiary.errors.UnavailableError` (network, 5xx, 429).
2. A permanent failure (:class:`~apiary.errors.ValidationError`: the contact has no phone, the
   provider answered 4xx) is not retried: the next channel is tried at once.
3. The first success ends the delivery; the later channels are not used.
4. Every try is handed to ``record`` as an :class:`Attempt`, so the caller writes it to the
   incident's timeline. When every channel fails, :meth:`Dispatcher.deliver` returns the attempts
   and raises nothing: the caller records the failure (and escalates).

A channel whose deliveries keep failing (``failure_threshold`` in a row, each after its retries)
is a **circuit breaker** opened for ``cooldown_s``: deliveries skip it (an attempt "skipped:
circuit open") and go to the next channel without spending retries and backoff on a peer known to
be down. After the cool-down one delivery probes it (half-open): success closes the circuit, a
failure opens it for another cool-down. Permanent failures do not count: they are about the
message or the contact, and they are fast anyway.

Channels are blocking and **not idempotent**: a try that timed out may have been delivered, so a
retry can page twice. Paging twice is the lesser evil; that is why every try is recorded.

SMS and phone are tested against a local fake of Twilio's REST API (``tests/support/
fake_providers.py``), not against Twilio itself; the request shapes follow Twilio's documentation
(``2010-04-01`` API: ``Messages.json``, ``Calls.json`` with ``Twiml``).
"""

from __future__ import annotations

import logging
import re
import smtplib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.message import EmailMessage
from email.utils import make_msgid
from enum import StrEnum
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit
from xml.sax.saxutils import escape as xml_escape

import httpx
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, model_validator

from apiary.errors import ApiaryError, UnavailableError, UserError, ValidationError
from apiary.oncall.common import FieldError, parse_model, parse_yaml

__all__ = [
    "Attempt",
    "Channel",
    "ChannelsConfig",
    "CircuitState",
    "Contact",
    "Dispatcher",
    "EmailChannel",
    "Message",
    "Outcome",
    "SlackChannel",
    "TeamsChannel",
    "TwilioSmsChannel",
    "TwilioVoiceChannel",
    "build_channels",
    "delivered",
    "load_channels_config",
    "parse_channels_config",
]

logger = logging.getLogger(__name__)

_SEVERITIES = ("sev1", "sev2", "sev3", "sev4")
_E164 = re.compile(r"^\+[1-9]\d{1,14}$")
#: Twilio's limit on an SMS body (characters); longer bodies are refused with error 21617.
SMS_MAX_CHARS = 1600


# --- what is sent, and to whom -------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """One notification about an incident, the same for every channel and recipient.

    ``severity`` is ``"sev1"`` (most severe) to ``"sev4"``; any case is accepted (``Sev2``, as
    :class:`apiary.oncall.routing.Severity` spells it) and kept lower case. ``body`` is plain
    text. ``ack_url`` and ``resolve_url`` are the signed links that acknowledge and resolve the
    incident (None where the sender has none). The recipient is not part of the message: it is the
    :class:`Contact` handed to :meth:`Channel.send` beside it, so one message goes to many people.
    Raises :class:`~apiary.errors.ValidationError` for an unknown severity.
    """

    incident_id: str
    severity: str
    title: str
    body: str = ""
    ack_url: str | None = None
    resolve_url: str | None = None

    def __post_init__(self) -> None:
        sev = str(self.severity).strip().lower()
        if sev not in _SEVERITIES:
            raise ValidationError("severity", f"expected one of sev1..sev4, got {self.severity!r}")
        object.__setattr__(self, "severity", sev)

    @property
    def label(self) -> str:
        """``SEV2``: the tag subjects and titles start with."""
        return self.severity.upper()

    @property
    def headline(self) -> str:
        """``[SEV2] title``."""
        return f"[{self.label}] {self.title}"


def _e164(value: str) -> str:
    if not _E164.fullmatch(value):
        raise ValueError(f"expected an E.164 phone number such as +14155550100 (no spaces), got {value!r}")
    return value


def _email(value: str) -> str:
    local, at, domain = value.rpartition("@")
    if not at or not local or "." not in domain or any(c.isspace() for c in value):
        raise ValueError(f"expected an email address such as alice@example.com, got {value!r}")
    return value


def _handle(value: str) -> str:
    value = value.strip().removeprefix("@")
    if not value or any(c.isspace() or c in "<>|" for c in value):
        raise ValueError(f"expected an IM handle (a Slack member ID such as U024BE7LH), got {value!r}")
    return value


def _http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError("expected an http:// or https:// URL")
    return value.rstrip("/")


#: A phone number in E.164 (``+14155550100``).
PhoneNumber = Annotated[str, AfterValidator(_e164)]
#: An email address (checked loosely: ``local@domain.tld``, no spaces).
EmailAddress = Annotated[str, AfterValidator(_email)]
#: An IM handle; a leading ``@`` is dropped.
ImHandle = Annotated[str, AfterValidator(_handle)]
#: An http(s) URL; a trailing ``/`` is dropped.
HttpUrl = Annotated[str, AfterValidator(_http_url)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Contact(_Model):
    """Where a person can be reached. Only ``name`` is required: a channel that needs an address
    the contact lacks fails permanently (:class:`~apiary.errors.ValidationError` naming
    ``contact.phone``, ...) and the dispatcher falls back to the next channel.

    ``im_handle`` is the person's member ID in the chat (``U024BE7LH`` in Slack, whose webhooks
    mention ``<@U024BE7LH>``; a display name does not notify anyone)."""

    name: str = Field(min_length=1, description="the person's user name in Apiary")
    email: EmailAddress | None = None
    phone: PhoneNumber | None = Field(None, description="E.164, for SMS and phone calls")
    im_handle: ImHandle | None = Field(None, description="chat member ID, for mentions")


# --- the channel interface -----------------------------------------------------------------------


class Channel(ABC):
    """One way to reach a person.

    :meth:`send` is **blocking** (bounded by the channel's ``timeout_s``, once per network
    exchange) and **not idempotent**: calling it twice may notify twice, and a timeout does not
    mean the message was not delivered. It raises:

    * :class:`~apiary.errors.UnavailableError` for failures worth retrying: the peer cannot be
      reached, timed out, answered 5xx or 429 (rate limited), or an SMTP 4xx;
    * :class:`~apiary.errors.ValidationError` for permanent failures, with ``field`` naming what
      is wrong: the contact has no address for this channel (``contact.phone``), the provider
      refused the request (a 4xx other than 429, an SMTP 5xx; ``twilio.auth_token``,
      ``slack.webhook_url``, ...). Retrying these unchanged fails again.

    Nothing else, barring bugs. Secrets (tokens, webhook URLs) never appear in the errors.
    """

    #: The channel's name (``email``, ``slack``, ``teams``, ``sms``, ``phone``).
    name: str

    @abstractmethod
    def send(self, message: Message, contact: Contact) -> str:
        """Deliver ``message`` to ``contact``; returns the provider's id for it (SMTP Message-ID,
        Twilio SID) or, where the provider gives none, a short detail (``HTTP 200 ok``)."""


def _require(value: str | None, field: str, channel: str) -> str:
    if not value:
        raise ValidationError(field, f"the contact has no {field.split('.')[-1]} for the {channel} channel")
    return value


def _links(message: Message) -> list[tuple[str, str]]:
    return [(label, url) for label, url in (("Acknowledge", message.ack_url), ("Resolve", message.resolve_url)) if url]


def _post(what: str, url: str, timeout_s: float, **kwargs: Any) -> httpx.Response:
    """POST; transport failures (refused, reset, timeout) become UnavailableError. The URL (a
    webhook URL is a secret) is not in the message."""
    try:
        return httpx.post(url, timeout=timeout_s, **kwargs)
    except httpx.HTTPError as e:
        raise UnavailableError(f"{what}: {type(e).__name__}: {e}") from e


def _check_status(what: str, field: str, r: httpx.Response, reason: str | None = None) -> None:
    """Raise for a non-2xx answer: 408, 429 and 5xx are UnavailableError, others ValidationError."""
    if r.is_success:
        return
    text = reason or r.text[:200]
    if r.status_code in (408, 429) or r.status_code >= 500:
        raise UnavailableError(f"{what}: HTTP {r.status_code}: {text}")
    raise ValidationError(field, f"{what} refused the message: HTTP {r.status_code}: {text}")


# --- email ---------------------------------------------------------------------------------------


class EmailChannel(Channel):
    """SMTP (plain or STARTTLS, optional login) to the contact's ``email``.

    Subject ``[SEV2] title``; the body is the message's body, then the acknowledge and resolve
    links and the incident id. Returns the Message-ID. An SMTP 4xx or a lost connection is
    UnavailableError; a 5xx is permanent (``contact.email`` when the recipient is refused,
    ``smtp.username`` when the login is, else ``smtp``)."""

    name = "email"

    def __init__(self, host: str, port: int, sender: str, *, starttls: bool = False,
                 username: str | None = None, password: str | None = None, timeout_s: float = 10.0) -> None:
        self.host, self.port, self.sender = host, port, sender
        self.starttls, self.username, self._password, self.timeout_s = starttls, username, password, timeout_s

    def compose(self, message: Message, contact: Contact) -> EmailMessage:
        """The RFC 5322 message :meth:`send` sends."""
        to = _require(contact.email, "contact.email", self.name)
        msg = EmailMessage()
        msg["Subject"] = message.headline
        msg["From"], msg["To"] = self.sender, to
        msg["Message-ID"] = make_msgid("apiary", domain=self.sender.rpartition("@")[2] or "apiary.local")
        msg["X-Apiary-Incident"] = message.incident_id
        lines = [message.body.rstrip(), ""] if message.body.strip() else []
        lines += [f"{label}: {url}" for label, url in _links(message)]
        lines += [f"Incident: {message.incident_id} ({message.label})"]
        msg.set_content("\n".join(lines) + "\n")
        return msg

    def send(self, message: Message, contact: Contact) -> str:
        msg = self.compose(message, contact)
        what = f"SMTP {self.host}:{self.port}"
        try:
            with smtplib.SMTP(self.host, self.port, timeout=self.timeout_s) as smtp:
                if self.starttls:
                    smtp.starttls()
                if self.username:
                    smtp.login(self.username, self._password or "")
                smtp.send_message(msg)
        except smtplib.SMTPRecipientsRefused as e:
            codes = [code for code, _ in e.recipients.values()]
            if codes and all(code >= 500 for code in codes):
                raise ValidationError("contact.email", f"{what} refused the recipient: {e.recipients}") from e
            raise UnavailableError(f"{what} deferred the recipient: {e.recipients}") from e
        except smtplib.SMTPNotSupportedError as e:
            raise ValidationError("smtp.starttls", f"{what}: {e}") from e
        except smtplib.SMTPResponseException as e:
            if e.smtp_code >= 500:
                field = "smtp.username" if isinstance(e, smtplib.SMTPAuthenticationError) else "smtp"
                raise ValidationError(field, f"{what}: {e.smtp_code} {e.smtp_error!r}") from e
            raise UnavailableError(f"{what}: {e.smtp_code} {e.smtp_error!r}") from e
        except (OSError, smtplib.SMTPException) as e:
            raise UnavailableError(f"{what} failed: {type(e).__name__}: {e}") from e
        return str(msg["Message-ID"])


# --- chat: Slack and Teams incoming webhooks -----------------------------------------------------


def _slack_escape(text: str) -> str:
    """Slack's mrkdwn escaping: ``&``, ``<`` and ``>`` only (api.slack.com, "Formatting text")."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class SlackChannel(Channel):
    """A Slack incoming webhook: POST ``{"text": ..., "blocks": [...]}`` (Block Kit).

    ``text`` is the notification fallback (``<@handle> [SEV2] title``); the blocks are a header,
    the body (mrkdwn, escaped), a context line with the incident and an actions block with the
    acknowledge and resolve links as URL buttons. The contact is mentioned (``<@im_handle>``) when
    known; without a handle the post still goes to the channel, naming the contact. Slack answers
    ``200 ok``; 4xx (``invalid_payload``, ``channel_not_found``, ``no_service``) are permanent,
    naming ``slack.webhook_url``."""

    name = "slack"

    def __init__(self, webhook_url: str, *, timeout_s: float = 10.0) -> None:
        self._url, self.timeout_s = webhook_url, timeout_s

    def payload(self, message: Message, contact: Contact) -> dict[str, Any]:
        """The JSON body :meth:`send` posts."""
        who = f"<@{contact.im_handle}>" if contact.im_handle else _slack_escape(contact.name)
        blocks: list[dict[str, Any]] = [
            {"type": "header", "text": {"type": "plain_text", "text": _clip(message.headline, 150)}},
            {"type": "section", "text": {"type": "mrkdwn",
                                         "text": _clip(f"{who}\n{_slack_escape(message.body)}".rstrip(), 3000)}},
            {"type": "context", "elements": [
                {"type": "mrkdwn", "text": f"Incident `{_slack_escape(message.incident_id)}` · {message.label}"}]},
        ]
        buttons = [
            {"type": "button", "text": {"type": "plain_text", "text": label}, "url": url,
             "action_id": f"apiary-{label.lower()}", **({"style": "primary"} if label == "Acknowledge" else {})}
            for label, url in _links(message)
        ]
        if buttons:
            blocks.append({"type": "actions", "elements": buttons})
        return {"text": f"{who} {_slack_escape(message.headline)}", "blocks": blocks}

    def send(self, message: Message, contact: Contact) -> str:
        r = _post("slack webhook", self._url, self.timeout_s, json=self.payload(message, contact))
        _check_status("slack webhook", "slack.webhook_url", r)
        return f"HTTP {r.status_code} {r.text[:100]}".rstrip()


_THEME = {"sev1": "B00020", "sev2": "E8590C", "sev3": "F2C744", "sev4": "6C757D"}


class TeamsChannel(Channel):
    """A Microsoft Teams incoming webhook: POST a MessageCard (the connector card format) whose
    ``potentialAction`` holds ``OpenUri`` actions for the acknowledge and resolve links.

    Teams cards cannot mention by handle over a webhook; the card names the contact in its facts.
    Legacy connectors answer ``200`` with ``1``, Workflows webhooks ``202``; a legacy connector
    also answers ``200`` with ``Webhook message delivery failed ... HTTP error 429`` when it
    throttles, which is UnavailableError (any other such failure is permanent,
    ``teams.webhook_url``)."""

    name = "teams"

    def __init__(self, webhook_url: str, *, timeout_s: float = 10.0) -> None:
        self._url, self.timeout_s = webhook_url, timeout_s

    def payload(self, message: Message, contact: Contact) -> dict[str, Any]:
        """The JSON body :meth:`send` posts."""
        facts = [{"name": "Incident", "value": message.incident_id},
                 {"name": "Severity", "value": message.label},
                 {"name": "On call", "value": contact.name + (f" (@{contact.im_handle})" if contact.im_handle else "")}]
        return {
            "@type": "MessageCard",
            "@context": "https://schema.org/extensions",
            "summary": message.headline,
            "themeColor": _THEME[message.severity],
            "title": message.headline,
            "text": message.body.replace("\n", "\n\n") or message.title,
            "sections": [{"facts": facts}],
            "potentialAction": [
                {"@type": "OpenUri", "name": label, "targets": [{"os": "default", "uri": url}]}
                for label, url in _links(message)
            ],
        }

    def send(self, message: Message, contact: Contact) -> str:
        r = _post("teams webhook", self._url, self.timeout_s, json=self.payload(message, contact))
        _check_status("teams webhook", "teams.webhook_url", r)
        if "delivery failed" in r.text.lower():
            if "429" in r.text:
                raise UnavailableError(f"teams webhook: throttled: {r.text[:200]}")
            raise ValidationError("teams.webhook_url", f"teams webhook refused the message: {r.text[:200]}")
        return f"HTTP {r.status_code} {r.text[:100]}".rstrip()


# --- SMS and phone: Twilio's REST API ------------------------------------------------------------

#: Twilio error codes that blame the number called or texted, not the account (400 answers).
_TWILIO_NUMBER_ERRORS = {21211, 21214, 21217, 21407, 21408, 21610, 21612, 21614}


class _Twilio:
    """``POST {base_url}/2010-04-01/Accounts/{sid}/{resource}.json``, form-encoded, basic auth."""

    def __init__(self, account_sid: str, auth_token: str, from_number: str, base_url: str, timeout_s: float) -> None:
        self.account_sid, self._auth_token, self.from_number = account_sid, auth_token, from_number
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s

    def create(self, resource: str, form: dict[str, str]) -> str:
        what = f"twilio {resource}"
        url = f"{self.base_url}/2010-04-01/Accounts/{self.account_sid}/{resource}.json"
        r = _post(what, url, self.timeout_s, data=form, auth=(self.account_sid, self._auth_token))
        try:
            data = r.json()
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}
        if not r.is_success:
            code = data.get("code")
            reason = f"{code} {data.get('message', '')}".strip() if code else None
            field = ("twilio.auth_token" if r.status_code in (401, 403)
                     else "contact.phone" if code in _TWILIO_NUMBER_ERRORS else "twilio")
            _check_status(what, field, r, reason)
        sid = data.get("sid")
        if not isinstance(sid, str) or not sid:
            raise UnavailableError(f"{what}: HTTP {r.status_code} without a sid: {r.text[:200]}")
        return sid


class TwilioSmsChannel(Channel):
    """SMS through Twilio's Messages API: ``To`` (the contact's phone), ``From``, ``Body``
    (``[SEV2] title (incident id)`` and the links, at most 1600 characters; the title is cut, the
    links never). Returns the message SID (``SM...``). 401/403 is permanent
    (``twilio.auth_token``), as is a 400 that blames the number (``contact.phone``)."""

    name = "sms"

    def __init__(self, account_sid: str, auth_token: str, from_number: str, *,
                 base_url: str = "https://api.twilio.com", timeout_s: float = 10.0) -> None:
        self._twilio = _Twilio(account_sid, auth_token, from_number, base_url, timeout_s)

    @staticmethod
    def text(message: Message) -> str:
        """The SMS body."""
        tail = "".join(f"\n{label}: {url}" for label, url in _links(message))
        head = f" (incident {message.incident_id})"
        room = SMS_MAX_CHARS - len(tail) - len(head)
        return _clip(message.headline, max(room, 1)) + head + tail

    def send(self, message: Message, contact: Contact) -> str:
        to = _require(contact.phone, "contact.phone", self.name)
        return self._twilio.create("Messages", {"To": to, "From": self._twilio.from_number,
                                                "Body": self.text(message)})


class TwilioVoiceChannel(Channel):
    """A phone call through Twilio's Calls API: ``To``, ``From`` and ``Twiml``, a ``<Say>`` (twice)
    of the severity, the title and the incident id. Returns the call SID (``CA...``).

    A voice call cannot carry a link, so with ``links_by_sms`` (the default) and a message that
    has links, the call says "the acknowledge link was sent to you by SMS" and, once Twilio has
    accepted the call, texts the links. That SMS is best effort: its failure does not fail the
    call (it shows in the returned detail), and it is sent after the call so a retried call does
    not text twice. Errors as :class:`TwilioSmsChannel`."""

    name = "phone"

    def __init__(self, account_sid: str, auth_token: str, from_number: str, *,
                 base_url: str = "https://api.twilio.com", timeout_s: float = 10.0, links_by_sms: bool = True) -> None:
        self._twilio = _Twilio(account_sid, auth_token, from_number, base_url, timeout_s)
        self._sms = TwilioSmsChannel(account_sid, auth_token, from_number, base_url=base_url, timeout_s=timeout_s)
        self.links_by_sms = links_by_sms

    def twiml(self, message: Message) -> str:
        """The TwiML document the call plays."""
        words = f"Apiary severity {message.severity[-1]} incident. {message.title}. Incident {message.incident_id}."
        if self.links_by_sms and _links(message):
            words += " The acknowledge link was sent to you by SMS."
        return f'<Response><Say loop="2">{xml_escape(words)}</Say></Response>'

    def send(self, message: Message, contact: Contact) -> str:
        to = _require(contact.phone, "contact.phone", self.name)
        sid = self._twilio.create("Calls", {"To": to, "From": self._twilio.from_number, "Twiml": self.twiml(message)})
        if self.links_by_sms and _links(message):
            try:
                return f"{sid} (links SMS {self._sms.send(message, contact)})"
            except ApiaryError as e:
                logger.warning("links SMS after call failed incident=%s call=%s error=%s",
                               message.incident_id, sid, e.message)
                return f"{sid} (links SMS failed: {e.message})"
        return sid


# --- configuration -------------------------------------------------------------------------------


class SmtpConfig(_Model):
    host: str = Field(min_length=1)
    port: int = Field(25, ge=1, le=65535)
    sender: EmailAddress = Field(description="the From address")
    starttls: bool = False
    username: str | None = None
    password: SecretStr | None = None
    timeout_s: float = Field(10.0, gt=0, description="per SMTP connection, seconds")


class WebhookConfig(_Model):
    webhook_url: HttpUrl = Field(description="the incoming webhook's URL (a secret: it is the credential)")
    timeout_s: float = Field(10.0, gt=0, description="per request, seconds")


class TwilioConfig(_Model):
    base_url: HttpUrl = Field("https://api.twilio.com", description="the API's root; a fake's in tests")
    account_sid: str = Field(pattern=r"^AC[0-9a-fA-F]{32}$", description="AC followed by 32 hex digits")
    auth_token: SecretStr
    from_number: PhoneNumber = Field(description="a Twilio number of the account, E.164")
    timeout_s: float = Field(10.0, gt=0, description="per request, seconds")
    voice_links_by_sms: bool = Field(True, description="after a phone call, text the acknowledge link")


class ChannelsConfig(_Model):
    """The channels, as YAML gives them (every section optional)::

        smtp: {host: smtp.example.com, port: 587, sender: oncall@example.com, starttls: true,
               username: apiary, password: ...}
        slack: {webhook_url: https://hooks.slack.com/services/...}
        teams: {webhook_url: https://example.webhook.office.com/...}
        twilio: {account_sid: AC..., auth_token: ..., from_number: "+14155550100"}
        im: slack            # which webhook the routing's "im" means; default slack if set, else teams
    """

    smtp: SmtpConfig | None = None
    slack: WebhookConfig | None = None
    teams: WebhookConfig | None = None
    twilio: TwilioConfig | None = None
    im: Literal["slack", "teams"] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChannelsConfig:
        if self.im is not None and getattr(self, self.im) is None:
            raise FieldError("im", f"{self.im} is chosen for im but has no {self.im} section")
        return self


def parse_channels_config(data: Any, field: str = "") -> ChannelsConfig:
    """A :class:`ChannelsConfig` from plain data. Raises :class:`~apiary.errors.ValidationError`
    naming the field (``twilio.from_number: expected an E.164 phone number ...``)."""
    return parse_model(ChannelsConfig, {} if data is None else data, field)


def load_channels_config(text: str | bytes) -> ChannelsConfig:
    """A :class:`ChannelsConfig` from YAML text. Raises :class:`~apiary.errors.ValidationError`."""
    return parse_channels_config(parse_yaml(text, field="channels", what="channels config"))


def build_channels(config: ChannelsConfig | Mapping[str, Any]) -> dict[str, Channel]:
    """The configured channels by name: ``email`` (smtp), ``slack``, ``teams``, ``im`` (the one
    ``config.im`` names: Slack if configured, else Teams), ``sms`` and ``phone`` (twilio). A
    section that is absent gives no channel; the dispatcher skips a routed name it lacks. Plain
    data is parsed first (:func:`parse_channels_config`)."""
    cfg = config if isinstance(config, ChannelsConfig) else parse_channels_config(config)
    out: dict[str, Channel] = {}
    if cfg.smtp:
        s = cfg.smtp
        out["email"] = EmailChannel(s.host, s.port, s.sender, starttls=s.starttls, username=s.username,
                                    password=s.password.get_secret_value() if s.password else None,
                                    timeout_s=s.timeout_s)
    if cfg.slack:
        out["slack"] = SlackChannel(cfg.slack.webhook_url, timeout_s=cfg.slack.timeout_s)
    if cfg.teams:
        out["teams"] = TeamsChannel(cfg.teams.webhook_url, timeout_s=cfg.teams.timeout_s)
    im = cfg.im or ("slack" if cfg.slack else "teams" if cfg.teams else None)
    if im:
        out["im"] = out[im]
    if cfg.twilio:
        t = cfg.twilio
        token = t.auth_token.get_secret_value()
        out["sms"] = TwilioSmsChannel(t.account_sid, token, t.from_number, base_url=t.base_url, timeout_s=t.timeout_s)
        out["phone"] = TwilioVoiceChannel(t.account_sid, token, t.from_number, base_url=t.base_url,
                                          timeout_s=t.timeout_s, links_by_sms=t.voice_links_by_sms)
    return out


# --- delivery: retries, fallback, circuit breaker -------------------------------------------------


class Outcome(StrEnum):
    """How one attempt ended."""

    SENT = "sent"
    #: A retryable failure (UnavailableError), or an unexpected error in the channel.
    FAILED = "failed"
    #: A permanent failure (a UserError such as ValidationError): not retried.
    REJECTED = "rejected"
    #: Not tried: the channel's circuit is open, or no channel has that name.
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Attempt:
    """One try of one channel for one message and recipient, for the incident's timeline.

    ``attempt`` counts from 1 within the channel for this delivery (0 for a skip); ``detail`` is
    the provider id on success, else the error (``skipped: circuit open until ...``); ``at`` is
    the dispatcher's clock when the try ended."""

    incident_id: str
    recipient: str
    channel: str
    attempt: int
    outcome: Outcome
    detail: str
    at: datetime

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.SENT

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a timeline entry (``at`` as ISO 8601, ``ok`` included)."""
        return {"incident_id": self.incident_id, "recipient": self.recipient, "channel": self.channel,
                "attempt": self.attempt, "outcome": self.outcome.value, "ok": self.ok, "detail": self.detail,
                "at": self.at.isoformat()}


def delivered(attempts: Sequence[Attempt]) -> Attempt | None:
    """The successful attempt among ``attempts`` (at most one per delivery), or None."""
    return next((a for a in attempts if a.ok), None)


@dataclass
class CircuitState:
    """A channel's breaker: ``failures`` failed deliveries in a row; open while ``open_until`` is
    in the future; ``probing`` while the one delivery after the cool-down is in flight."""

    failures: int = 0
    open_until: datetime | None = None
    probing: bool = False


def _utcnow() -> datetime:
    return datetime.now(UTC)


class Dispatcher:
    """Delivers a message over an ordered list of channels (see the module docstring).

    ``channels`` maps names (those :func:`build_channels` gives) to channels. ``attempts`` tries
    per channel (>= 1); ``backoff_s[i]`` is the sleep before try ``i + 2`` (the last value repeats);
    ``failure_threshold`` failed deliveries in a row open a channel's circuit for ``cooldown_s``
    seconds. ``record`` receives every :class:`Attempt` as it happens (an exception in it is logged
    and ignored); ``clock`` (aware datetimes) and ``sleep`` are injectable for tests.

    Thread-safe: deliveries may run concurrently; the breakers' state is behind a lock, and sends
    run outside it.
    """

    def __init__(self, channels: Mapping[str, Channel], *, attempts: int = 3,
                 backoff_s: Sequence[float] = (0.5, 2.0), failure_threshold: int = 3, cooldown_s: float = 300.0,
                 record: Callable[[Attempt], None] | None = None, clock: Callable[[], datetime] = _utcnow,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if attempts < 1:
            raise ValidationError("attempts", f"must be at least 1, got {attempts}")
        if failure_threshold < 1:
            raise ValidationError("failure_threshold", f"must be at least 1, got {failure_threshold}")
        if cooldown_s < 0 or any(b < 0 for b in backoff_s):
            raise ValidationError("cooldown_s" if cooldown_s < 0 else "backoff_s", "must not be negative")
        self.channels = dict(channels)
        self.attempts, self.backoff_s = attempts, tuple(backoff_s)
        self.failure_threshold, self.cooldown = failure_threshold, timedelta(seconds=cooldown_s)
        self._record, self._clock, self._sleep = record, clock, sleep
        self._lock = threading.Lock()
        self._circuits: dict[str, CircuitState] = {}

    def circuit(self, name: str) -> CircuitState:
        """A copy of channel ``name``'s breaker state."""
        with self._lock:
            state = self._circuits.get(name, CircuitState())
            return CircuitState(state.failures, state.open_until, state.probing)

    def deliver(self, message: Message, contact: Contact, channels: Sequence[str]) -> list[Attempt]:
        """Try ``channels`` (names, in fallback order; repeats ignored) until one delivers. Returns
        every attempt, in order; the last is the success, if any (:func:`delivered`). Never raises
        for a channel's failure."""
        tries: list[Attempt] = []
        for name in dict.fromkeys(channels):
            channel = self.channels.get(name)
            if channel is None:
                self._note(tries, message, contact, name, 0, Outcome.SKIPPED, "skipped: channel not configured")
                continue
            skip = self._admit(name)
            if skip:
                self._note(tries, message, contact, name, 0, Outcome.SKIPPED, skip)
                continue
            if self._try_channel(tries, channel, name, message, contact):
                break
        else:
            logger.error("notification failed on every channel incident=%s recipient=%s channels=%s",
                         message.incident_id, contact.name, ",".join(channels))
        return tries

    # 1. admission: may this delivery use the channel?
    def _admit(self, name: str) -> str | None:
        """None if the channel may be tried now, else why not. After the cool-down the first
        caller becomes the probe; others keep skipping until the probe ends."""
        now = self._clock()
        with self._lock:
            state = self._circuits.setdefault(name, CircuitState())
            if state.open_until is None:
                return None
            if now < state.open_until:
                return f"skipped: circuit open until {state.open_until.isoformat()}"
            if state.probing:
                return "skipped: circuit half-open, a probe is in flight"
            state.probing = True
            return None

    # 2. the tries, with backoff between them
    def _try_channel(self, tries: list[Attempt], channel: Channel, name: str, message: Message,
                     contact: Contact) -> bool:
        for n in range(1, self.attempts + 1):
            if n > 1:
                self._sleep(self.backoff_s[min(n - 2, len(self.backoff_s) - 1)] if self.backoff_s else 0.0)
            try:
                detail = channel.send(message, contact)
            except UserError as e:  # permanent: no retries, and no verdict on the channel's health
                self._note(tries, message, contact, name, n, Outcome.REJECTED, e.message)
                self._settle(name, None)
                return False
            except UnavailableError as e:
                self._note(tries, message, contact, name, n, Outcome.FAILED, e.message)
                continue
            except Exception as e:  # a bug in the channel: record it, do not retry, do not raise
                logger.exception("channel raised unexpectedly channel=%s incident=%s", name, message.incident_id)
                self._note(tries, message, contact, name, n, Outcome.FAILED, f"{type(e).__name__}: {e}")
                break
            self._note(tries, message, contact, name, n, Outcome.SENT, detail)
            self._settle(name, True)
            return True
        self._settle(name, False)
        return False

    # 3. the verdict on the channel's health
    def _settle(self, name: str, ok: bool | None) -> None:
        """Update the breaker: ``ok`` True closes it, False counts a failed delivery (opening the
        circuit at the threshold), None only ends a probe."""
        now = self._clock()
        with self._lock:
            state = self._circuits.setdefault(name, CircuitState())
            state.probing = False
            if ok is None:
                return
            if ok:
                state.failures, state.open_until = 0, None
                return
            state.failures += 1
            # A failed probe reopens at once: failures only reset on a success, so the count is
            # still at the threshold.
            if state.failures >= self.failure_threshold:
                state.open_until = now + self.cooldown
                logger.warning("channel circuit opened channel=%s failures=%d until=%s",
                               name, state.failures, state.open_until.isoformat())

    def _note(self, tries: list[Attempt], message: Message, contact: Contact, name: str, n: int,
              outcome: Outcome, detail: str) -> None:
        attempt = Attempt(message.incident_id, contact.name, name, n, outcome, detail, self._clock())
        tries.append(attempt)
        log = logger.info if outcome is Outcome.SENT else logger.warning
        log("notification %s incident=%s recipient=%s channel=%s attempt=%d detail=%s",
            outcome.value, message.incident_id, contact.name, name, n, detail)
        if self._record is not None:
            try:
                self._record(attempt)
            except Exception:
                logger.exception("recording a notification attempt failed incident=%s", message.incident_id)
