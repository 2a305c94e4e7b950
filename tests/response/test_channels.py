"""Notification channels and the dispatcher.

Email goes to a real SMTP server on loopback (aiosmtpd, the ``smtp`` fixture) and is read back
from it. Slack, Teams and Twilio are local fakes on loopback (tests/support/fake_providers.py):
SMS and phone calls are tested against a fake written from Twilio's documentation, not against
Twilio. Time is injected: the dispatcher's clock and sleep are fakes, nothing here waits on the
wall clock.
"""

from __future__ import annotations

import email
import email.policy
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pydantic
import pytest
from aiosmtpd.controller import Controller
from tests.support.fake_providers import ACCOUNT_SID, AUTH_TOKEN, FakeTwilio, FakeWebhook

from apiary.errors import UnavailableError, ValidationError
from apiary.oncall.routing import DEFAULT_ROUTING, Severity
from apiary.response.channels import (
    Attempt,
    Channel,
    ChannelsConfig,
    Contact,
    Dispatcher,
    EmailChannel,
    Message,
    Outcome,
    SlackChannel,
    TeamsChannel,
    TwilioSmsChannel,
    TwilioVoiceChannel,
    build_channels,
    delivered,
    load_channels_config,
)
from apiary.tracking.prefect_server import free_port

FROM = "+15005550006"
ACK = "https://apiary.example/i/INC-7/ack?sig=abc"
RESOLVE = "https://apiary.example/i/INC-7/resolve?sig=def"


# --- builders ------------------------------------------------------------------------------------


def message(**kw) -> Message:
    fields = dict(incident_id="INC-7", severity="sev2", title="ECC errors on worker-1",
                  body="Double-bit ECC on GPU 0.\nJobs on the node may fail.", ack_url=ACK, resolve_url=RESOLVE)
    return Message(**{**fields, **kw})


def alice(**kw) -> Contact:
    fields = dict(name="alice", email="alice@example.test", phone="+14155550100", im_handle="U024BE7LH")
    return Contact(**{**fields, **kw})


class Clock:
    """An injected clock: ``clock()`` is now; ``advance(s)`` moves it."""

    def __init__(self) -> None:
        self.now = datetime(2026, 3, 2, 10, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


class Scripted(Channel):
    """A channel that plays a script: each send pops the next item (an exception to raise, or a
    string to return); an empty script returns ``"ok"``."""

    def __init__(self, name: str, *script: str | Exception) -> None:
        self.name, self.script, self.sent = name, list(script), 0

    def send(self, message: Message, contact: Contact) -> str:
        self.sent += 1
        step = self.script.pop(0) if self.script else "ok"
        if isinstance(step, Exception):
            raise step
        return step


def down(name: str, times: int = 100) -> Scripted:
    return Scripted(name, *[UnavailableError(f"{name} is down") for _ in range(times)])


def dispatcher(channels: dict[str, Channel], **kw) -> tuple[Dispatcher, list[Attempt], list[float], Clock]:
    """A dispatcher with a recorded ``record``, a recorded ``sleep`` and a fake clock."""
    recorded: list[Attempt] = []
    sleeps: list[float] = []
    clock = Clock()
    d = Dispatcher(channels, record=recorded.append, sleep=sleeps.append, clock=kw.pop("clock", clock), **kw)
    return d, recorded, sleeps, clock


def summary(attempts: list[Attempt]) -> list[tuple[str, int, str]]:
    return [(a.channel, a.attempt, a.outcome.value) for a in attempts]


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture
def twilio() -> Iterator[FakeTwilio]:
    with FakeTwilio() as fake:
        yield fake


@pytest.fixture
def slack() -> Iterator[FakeWebhook]:
    with FakeWebhook() as fake:
        yield fake


@pytest.fixture
def teams() -> Iterator[FakeWebhook]:
    with FakeWebhook(ok_body="1") as fake:
        yield fake


def sms(twilio: FakeTwilio, token: str = AUTH_TOKEN) -> TwilioSmsChannel:
    return TwilioSmsChannel(ACCOUNT_SID, token, FROM, base_url=twilio.url)


def voice(twilio: FakeTwilio, **kw) -> TwilioVoiceChannel:
    return TwilioVoiceChannel(ACCOUNT_SID, AUTH_TOKEN, FROM, base_url=twilio.url, **kw)


def nowhere() -> str:
    """A loopback URL where nothing listens (connection refused)."""
    return f"http://127.0.0.1:{free_port()}/hook"


# --- messages and contacts -----------------------------------------------------------------------


@pytest.mark.parametrize("given", ["sev2", "Sev2", "SEV2", Severity.SEV2], ids=["lower", "routing", "upper", "enum"])
def test_message_severity_is_normalised(given):
    m = message(severity=given)
    assert (m.severity, m.headline) == ("sev2", "[SEV2] ECC errors on worker-1")


def test_message_refuses_an_unknown_severity():
    with pytest.raises(ValidationError) as e:
        message(severity="sev5")
    assert e.value.field == "severity"


@pytest.mark.parametrize("phone", ["4155550100", "+1 415 555 0100", "+0123456", "+1234567890123456"],
                         ids=["no-plus", "spaces", "leading-zero", "too-long"])
def test_contact_phone_must_be_e164(phone):
    with pytest.raises(pydantic.ValidationError, match="E.164"):
        alice(phone=phone)


def test_contact_handle_drops_the_at_and_unknown_fields_are_refused():
    assert alice(im_handle="@U024BE7LH").im_handle == "U024BE7LH"
    with pytest.raises(pydantic.ValidationError, match="Extra inputs"):
        Contact(name="bob", pager="123")
    with pytest.raises(pydantic.ValidationError, match="email address"):
        alice(email="alice")


# --- email ---------------------------------------------------------------------------------------


def test_email_goes_to_the_contact_with_subject_and_links(smtp):
    controller, inbox = smtp
    channel = EmailChannel("127.0.0.1", controller.port, "oncall@apiary.test")
    msg_id = channel.send(message(), alice())
    assert len(inbox.messages) == 1
    envelope = inbox.messages[0]
    assert envelope.rcpt_tos == ["alice@example.test"] and envelope.mail_from == "oncall@apiary.test"
    received = email.message_from_bytes(envelope.content, policy=email.policy.default)
    assert received["Subject"] == "[SEV2] ECC errors on worker-1"
    assert received["Message-ID"] == msg_id and received["X-Apiary-Incident"] == "INC-7"
    text = received.get_content()
    assert "Double-bit ECC on GPU 0." in text
    assert f"Acknowledge: {ACK}" in text and f"Resolve: {RESOLVE}" in text


def test_email_without_links_or_address(smtp):
    controller, inbox = smtp
    channel = EmailChannel("127.0.0.1", controller.port, "oncall@apiary.test")
    channel.send(message(ack_url=None, resolve_url=None), alice())
    assert "Acknowledge" not in inbox.messages[0].content.decode()
    with pytest.raises(ValidationError) as e:
        channel.send(message(), alice(email=None))
    assert e.value.field == "contact.email" and len(inbox.messages) == 1


def test_email_server_down_is_retryable():
    with pytest.raises(UnavailableError):
        EmailChannel("127.0.0.1", free_port(), "oncall@apiary.test", timeout_s=5).send(message(), alice())


class _Refusing:
    """An aiosmtpd handler that answers RCPT TO with ``reply``."""

    def __init__(self, reply: str) -> None:
        self.reply = reply

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):  # aiosmtpd hook
        return self.reply


@pytest.mark.parametrize("reply, error", [("550 5.1.1 no such user", ValidationError),
                                          ("451 4.3.0 try again later", UnavailableError)], ids=["5xx", "4xx"])
def test_email_recipient_refused(reply, error):
    controller = Controller(_Refusing(reply), hostname="127.0.0.1", port=free_port())
    controller.start()
    try:
        with pytest.raises(error) as e:
            EmailChannel("127.0.0.1", controller.port, "oncall@apiary.test").send(message(), alice())
    finally:
        controller.stop()
    if error is ValidationError:
        assert e.value.field == "contact.email"


# --- Slack and Teams -----------------------------------------------------------------------------


def test_slack_posts_text_and_blocks_with_mention_and_buttons(slack):
    detail = SlackChannel(slack.url + "/services/T/B/X").send(message(body="a <b> & c"), alice())
    assert detail == "HTTP 200 ok"
    [post] = slack.posts
    assert post["text"] == "<@U024BE7LH> [SEV2] ECC errors on worker-1"
    header, section, context, actions = post["blocks"]
    assert header == {"type": "header", "text": {"type": "plain_text", "text": "[SEV2] ECC errors on worker-1"}}
    assert section["text"] == {"type": "mrkdwn", "text": "<@U024BE7LH>\na &lt;b&gt; &amp; c"}
    assert "INC-7" in context["elements"][0]["text"]
    assert [(b["type"], b["text"]["text"], b["url"]) for b in actions["elements"]] == [
        ("button", "Acknowledge", ACK), ("button", "Resolve", RESOLVE)]


def test_slack_without_handle_or_links_names_the_contact_and_has_no_actions(slack):
    SlackChannel(slack.url).send(message(ack_url=None, resolve_url=None), alice(im_handle=None))
    [post] = slack.posts
    assert "<@" not in post["text"] and post["text"].startswith("alice ")
    assert [b["type"] for b in post["blocks"]] == ["header", "section", "context"]


def test_teams_posts_a_message_card_with_open_uri_actions(teams):
    detail = TeamsChannel(teams.url).send(message(severity="sev1"), alice())
    assert detail == "HTTP 200 1"
    [card] = teams.posts
    assert card["@type"] == "MessageCard" and card["title"] == "[SEV1] ECC errors on worker-1"
    assert card["summary"] == card["title"] and card["themeColor"]
    assert card["potentialAction"] == [
        {"@type": "OpenUri", "name": "Acknowledge", "targets": [{"os": "default", "uri": ACK}]},
        {"@type": "OpenUri", "name": "Resolve", "targets": [{"os": "default", "uri": RESOLVE}]},
    ]
    facts = {f["name"]: f["value"] for f in card["sections"][0]["facts"]}
    assert facts == {"Incident": "INC-7", "Severity": "SEV1", "On call": "alice (@U024BE7LH)"}


@pytest.mark.parametrize("body, error", [
    ("Webhook message delivery failed with error: Microsoft Teams endpoint returned HTTP error 429", UnavailableError),
    ("Webhook message delivery failed with error: Microsoft Teams endpoint returned HTTP error 413", ValidationError),
], ids=["throttled", "too-large"])
def test_teams_legacy_failure_inside_a_200(teams, body, error):
    teams.fail_next(1, status=200, body=body)
    with pytest.raises(error):
        TeamsChannel(teams.url).send(message(), alice())


@pytest.mark.parametrize("status, error", [(500, UnavailableError), (503, UnavailableError),
                                           (429, UnavailableError), (400, ValidationError),
                                           (404, ValidationError), (410, ValidationError)],
                         ids=lambda v: str(v) if isinstance(v, int) else v.__name__)
def test_webhook_status_classes(slack, status, error):
    url = slack.url + "/services/T000/B000/SECRETTOKEN"
    slack.fail_next(1, status=status)
    with pytest.raises(error) as e:
        SlackChannel(url).send(message(), alice())
    assert "SECRETTOKEN" not in str(e.value)  # the webhook URL is a credential
    if error is ValidationError:
        assert e.value.field == "slack.webhook_url"


def test_webhook_down_is_retryable():
    with pytest.raises(UnavailableError):
        SlackChannel(nowhere(), timeout_s=5).send(message(), alice())


# --- Twilio: SMS and phone -----------------------------------------------------------------------


def test_sms_request_shape(twilio):
    sid = sms(twilio).send(message(), alice())
    assert sid.startswith("SM") and len(sid) == 34
    [req] = twilio.requests
    assert req.path == f"/2010-04-01/Accounts/{ACCOUNT_SID}/Messages.json" and req.status == 201
    assert req.headers["content-type"].startswith("application/x-www-form-urlencoded")
    assert set(req.body) == {"To", "From", "Body"}
    assert (req.body["To"], req.body["From"]) == ("+14155550100", FROM)
    assert req.body["Body"] == (f"[SEV2] ECC errors on worker-1 (incident INC-7)\nAcknowledge: {ACK}\n"
                                f"Resolve: {RESOLVE}")


def test_sms_long_title_is_cut_but_links_are_kept(twilio):
    sms(twilio).send(message(title="x" * 5000), alice())
    [body] = [m["Body"] for m in twilio.messages]
    assert len(body) == 1600 and body.endswith(f"Resolve: {RESOLVE}")


def test_voice_call_says_the_title_and_texts_the_links(twilio):
    detail = voice(twilio).send(message(title="GPU <hot> & loud"), alice())
    [call], [text] = twilio.calls, twilio.messages
    assert set(call) == {"To", "From", "Twiml"} and call["To"] == "+14155550100"
    assert call["Twiml"].startswith("<Response><Say") and call["Twiml"].endswith("</Say></Response>")
    assert "GPU &lt;hot&gt; &amp; loud" in call["Twiml"] and "sent to you by SMS" in call["Twiml"]
    assert ACK in text["Body"]
    assert [r.path.rsplit("/", 1)[1] for r in twilio.requests] == ["Calls.json", "Messages.json"]  # call first
    assert detail.startswith("CA") and "(links SMS SM" in detail


def test_voice_call_without_links_sends_no_sms(twilio):
    detail = voice(twilio).send(message(ack_url=None, resolve_url=None), alice())
    assert len(twilio.calls) == 1 and twilio.messages == []
    assert "SMS" not in twilio.calls[0]["Twiml"] and detail.startswith("CA") and "(" not in detail


def test_voice_call_succeeds_when_the_links_sms_fails(twilio):
    twilio.fail_next(1, status=500, path_contains="/Messages.json")
    detail = voice(twilio).send(message(), alice())
    assert len(twilio.calls) == 1 and twilio.messages == []
    assert [r.status for r in twilio.requests] == [201, 500]
    assert detail.startswith("CA") and "links SMS failed" in detail


@pytest.mark.parametrize("status, error, field", [
    (500, UnavailableError, None), (429, UnavailableError, None), (400, ValidationError, "contact.phone"),
], ids=["500", "429", "400-bad-number"])
def test_twilio_error_classes(twilio, status, error, field):
    twilio.fail_next(1, status=status)
    with pytest.raises(error) as e:
        sms(twilio).send(message(), alice())
    if field:
        assert e.value.field == field


def test_twilio_bad_credentials_are_permanent_and_secret(twilio):
    with pytest.raises(ValidationError) as e:
        sms(twilio, token="wrong-token").send(message(), alice())
    assert e.value.field == "twilio.auth_token" and "wrong-token" not in str(e.value)
    assert [r.status for r in twilio.requests] == [401]


@pytest.mark.parametrize("make", [sms, voice], ids=["sms", "phone"])
def test_twilio_contact_without_phone_is_refused_before_any_request(twilio, make):
    with pytest.raises(ValidationError) as e:
        make(twilio).send(message(), alice(phone=None))
    assert e.value.field == "contact.phone" and twilio.requests == []


# --- configuration -------------------------------------------------------------------------------


def config(twilio_url: str = "http://127.0.0.1:1", **kw) -> dict:
    data = {
        "smtp": {"host": "127.0.0.1", "port": 2525, "sender": "oncall@apiary.test", "password": "smtp-secret"},
        "slack": {"webhook_url": "http://127.0.0.1:1/slack"},
        "teams": {"webhook_url": "http://127.0.0.1:1/teams"},
        "twilio": {"base_url": twilio_url, "account_sid": ACCOUNT_SID, "auth_token": "tw-secret",
                   "from_number": FROM},
    }
    return {**data, **kw}


def test_build_channels_names_every_routing_channel():
    channels = build_channels(config())
    assert sorted(channels) == ["email", "im", "phone", "slack", "sms", "teams"]
    assert channels["im"] is channels["slack"]
    assert isinstance(channels["phone"], TwilioVoiceChannel) and isinstance(channels["email"], EmailChannel)
    assert build_channels(config(im="teams"))["im"] is not None
    assert isinstance(build_channels(config(im="teams"))["im"], TeamsChannel)
    assert isinstance(build_channels({"teams": config()["teams"]})["im"], TeamsChannel)
    assert build_channels({}) == {}


def test_load_channels_config_from_yaml_hides_secrets():
    cfg = load_channels_config(
        "smtp: {host: smtp.example.com, port: 587, sender: oncall@example.com, starttls: true,"
        " username: apiary, password: hunter2}\n"
        f"twilio: {{account_sid: {ACCOUNT_SID}, auth_token: tw-secret, from_number: '{FROM}'}}\n")
    assert isinstance(cfg, ChannelsConfig) and cfg.smtp is not None and cfg.smtp.starttls
    assert "hunter2" not in repr(cfg) and "tw-secret" not in repr(cfg)
    assert sorted(build_channels(cfg)) == ["email", "phone", "sms"]


@pytest.mark.parametrize("data, field", [
    ({"im": "teams", "slack": {"webhook_url": "https://hooks.slack.com/x"}}, "im"),
    ({"twilio": {**config()["twilio"], "from_number": "5550006"}}, "twilio.from_number"),
    ({"twilio": {**config()["twilio"], "account_sid": "XX1"}}, "twilio.account_sid"),
    ({"slack": {"webhook_url": "ftp://example.com/x"}}, "slack.webhook_url"),
    ({"smtp": {"host": "h", "sender": "oncall@apiary.test", "port": 0}}, "smtp.port"),
    ({"sms": {}}, "sms"),
], ids=["im-unset", "from-number", "account-sid", "webhook-scheme", "smtp-port", "unknown-section"])
def test_config_errors_name_the_field(data, field):
    with pytest.raises(ValidationError) as e:
        build_channels(data)
    assert e.value.field == field


# --- the dispatcher ------------------------------------------------------------------------------


def test_retry_then_success_stops_there(slack, smtp):
    controller, inbox = smtp
    slack.fail_next(2, status=503)
    channels = {"im": SlackChannel(slack.url), "email": EmailChannel("127.0.0.1", controller.port, "o@apiary.test")}
    d, recorded, sleeps, clock = dispatcher(channels, attempts=3, backoff_s=(0.5, 2.0))
    attempts = d.deliver(message(), alice(), ["im", "email"])
    assert summary(attempts) == [("im", 1, "failed"), ("im", 2, "failed"), ("im", 3, "sent")]
    assert sleeps == [0.5, 2.0] and len(slack.posts) == 1 and inbox.messages == []
    assert recorded == attempts and delivered(attempts) == attempts[-1]
    assert attempts[-1].detail == "HTTP 200 ok" and "503" in attempts[0].detail
    assert all(a.at == clock.now and a.incident_id == "INC-7" and a.recipient == "alice" for a in attempts)


def test_backoff_repeats_its_last_value():
    d, _, sleeps, _ = dispatcher({"im": down("im")}, attempts=4, backoff_s=(1.0,))
    d.deliver(message(), alice(), ["im"])
    assert sleeps == [1.0, 1.0, 1.0]


def test_permanent_error_falls_back_at_once_without_retries(twilio, slack):
    twilio.fail_next(1, status=400)
    d, recorded, sleeps, _ = dispatcher({"sms": sms(twilio), "im": SlackChannel(slack.url)}, attempts=3)
    attempts = d.deliver(message(), alice(), ["sms", "im"])
    assert summary(attempts) == [("sms", 1, "rejected"), ("im", 1, "sent")]
    assert sleeps == [] and len(twilio.requests) == 1 and len(slack.posts) == 1
    assert "21211" in attempts[0].detail


def test_fallback_follows_the_given_order_after_retries(twilio, slack):
    channels = {"phone": Scripted("phone", UnavailableError("busy"), UnavailableError("busy")),
                "sms": sms(twilio), "im": SlackChannel(slack.url)}
    d, recorded, _, _ = dispatcher(channels, attempts=2)
    attempts = d.deliver(message(), alice(), ["phone", "sms", "im"])
    assert summary(attempts) == [("phone", 1, "failed"), ("phone", 2, "failed"), ("sms", 1, "sent")]
    assert attempts[-1].detail.startswith("SM") and slack.posts == [] and len(twilio.messages) == 1


def test_all_channels_failing_returns_every_attempt_without_raising(twilio):
    channels = {"phone": voice(twilio), "im": SlackChannel(nowhere(), timeout_s=5)}
    d, recorded, _, _ = dispatcher(channels, attempts=2)
    attempts = d.deliver(message(), alice(phone=None), ["phone", "im", "email"])
    assert summary(attempts) == [("phone", 1, "rejected"), ("im", 1, "failed"), ("im", 2, "failed"),
                                 ("email", 0, "skipped")]
    assert attempts[-1].detail == "skipped: channel not configured"
    assert delivered(attempts) is None and recorded == attempts and twilio.requests == []


def test_a_bug_in_a_channel_is_recorded_not_retried_not_raised():
    d, _, sleeps, _ = dispatcher({"im": Scripted("im", KeyError("oops")), "email": Scripted("email")}, attempts=3)
    attempts = d.deliver(message(), alice(), ["im", "email"])
    assert summary(attempts) == [("im", 1, "failed"), ("email", 1, "sent")] and sleeps == []
    assert "KeyError" in attempts[0].detail


def test_a_failing_record_does_not_stop_delivery():
    def record(attempt):
        raise RuntimeError("timeline store down")

    d = Dispatcher({"email": Scripted("email")}, record=record, sleep=lambda s: None)
    assert [a.ok for a in d.deliver(message(), alice(), ["email"])] == [True]


def test_repeated_names_are_tried_once():
    im = down("im")
    d, _, _, _ = dispatcher({"im": im}, attempts=1)
    d.deliver(message(), alice(), ["im", "im"])
    assert im.sent == 1


def test_attempt_to_dict_for_the_timeline():
    d, _, _, clock = dispatcher({"email": Scripted("email", "<id@x>")})
    [a] = d.deliver(message(), alice(), ["email"])
    assert a.to_dict() == {"incident_id": "INC-7", "recipient": "alice", "channel": "email", "attempt": 1,
                           "outcome": "sent", "ok": True, "detail": "<id@x>", "at": clock.now.isoformat()}


@pytest.mark.parametrize("kw, field", [({"attempts": 0}, "attempts"), ({"failure_threshold": 0}, "failure_threshold"),
                                       ({"backoff_s": (1.0, -1.0)}, "backoff_s"), ({"cooldown_s": -1}, "cooldown_s")])
def test_dispatcher_settings_are_checked(kw, field):
    with pytest.raises(ValidationError) as e:
        Dispatcher({}, **kw)
    assert e.value.field == field


# --- the circuit breaker -------------------------------------------------------------------------


def test_circuit_opens_after_consecutive_failures_and_closes_after_a_good_probe():
    phone, sms_ = down("phone", times=3), Scripted("sms")
    d, recorded, _, clock = dispatcher({"phone": phone, "sms": sms_}, attempts=1, failure_threshold=2,
                                       cooldown_s=300)
    # 1. two failed deliveries in a row open the circuit
    for _ in range(2):
        d.deliver(message(), alice(), ["phone", "sms"])
    assert phone.sent == 2 and d.circuit("phone").open_until == clock.now + timedelta(seconds=300)
    # 2. while open, the phone is skipped straight to SMS, and the skip is recorded
    clock.advance(299)
    attempts = d.deliver(message(), alice(), ["phone", "sms"])
    assert summary(attempts) == [("phone", 0, "skipped"), ("sms", 1, "sent")] and phone.sent == 2
    assert attempts[0].detail.startswith("skipped: circuit open until") and recorded[-2] == attempts[0]
    # 3. after the cool-down one delivery probes; it fails, so the circuit opens again at once
    clock.advance(1)
    attempts = d.deliver(message(), alice(), ["phone", "sms"])
    assert summary(attempts) == [("phone", 1, "failed"), ("sms", 1, "sent")] and phone.sent == 3
    assert d.circuit("phone").open_until == clock.now + timedelta(seconds=300)
    assert summary(d.deliver(message(), alice(), ["phone", "sms"]))[0] == ("phone", 0, "skipped")
    # 4. the next probe succeeds (the script is spent): the circuit closes
    clock.advance(300)
    attempts = d.deliver(message(), alice(), ["phone", "sms"])
    assert summary(attempts) == [("phone", 1, "sent")]
    assert d.circuit("phone").open_until is None and d.circuit("phone").failures == 0
    assert summary(d.deliver(message(), alice(), ["phone", "sms"])) == [("phone", 1, "sent")]


def test_a_success_resets_the_count_of_failures():
    im = Scripted("im", UnavailableError("x"), "ok", UnavailableError("x"))
    d, _, _, _ = dispatcher({"im": im, "email": Scripted("email")}, attempts=1, failure_threshold=2)
    for _ in range(3):
        d.deliver(message(), alice(), ["im", "email"])
    assert d.circuit("im").failures == 1 and d.circuit("im").open_until is None


def test_permanent_failures_do_not_open_the_circuit():
    phone = Scripted("phone", *[ValidationError("contact.phone", "no phone") for _ in range(5)])
    d, _, _, _ = dispatcher({"phone": phone, "sms": Scripted("sms")}, attempts=3, failure_threshold=2)
    for _ in range(5):
        d.deliver(message(), alice(), ["phone", "sms"])
    assert phone.sent == 5 and d.circuit("phone").open_until is None


def test_retries_within_one_delivery_count_once():
    d, _, _, _ = dispatcher({"im": down("im")}, attempts=3, failure_threshold=2)
    d.deliver(message(), alice(), ["im"])
    assert d.circuit("im").failures == 1 and d.circuit("im").open_until is None


def test_only_one_probe_at_a_time():
    """Two deliveries after the cool-down, concurrently: one probes, the other skips."""
    probe_started, release = threading.Event(), threading.Event()

    class Slow(Channel):
        name = "phone"
        failing = True

        def send(self, message, contact):
            if self.failing:
                raise UnavailableError("down")
            probe_started.set()
            assert release.wait(10), "the test never released the probe"
            return "ok"

    phone = Slow()
    d, _, _, clock = dispatcher({"phone": phone, "sms": Scripted("sms")}, attempts=1, failure_threshold=1,
                                cooldown_s=60)
    d.deliver(message(), alice(), ["phone", "sms"])
    assert d.circuit("phone").open_until is not None
    clock.advance(60)
    phone.failing = False
    results: list[list[Attempt]] = []
    probe = threading.Thread(target=lambda: results.append(d.deliver(message(), alice(), ["phone", "sms"])))
    probe.start()
    try:
        assert probe_started.wait(10), "the probe never started"
        assert d.circuit("phone").probing
        other = d.deliver(message(), alice(), ["phone", "sms"])
        assert summary(other) == [("phone", 0, "skipped"), ("sms", 1, "sent")]
        assert "half-open" in other[0].detail
    finally:
        release.set()
        probe.join(10)
    assert summary(results[0]) == [("phone", 1, "sent")] and d.circuit("phone").open_until is None


# --- routing drives the dispatcher ---------------------------------------------------------------

SATURDAY_3AM = datetime(2026, 3, 7, 3, 0, tzinfo=UTC)
TUESDAY_11AM = datetime(2026, 3, 3, 11, 0, tzinfo=UTC)


@pytest.mark.parametrize("severity, at, expected", [
    (Severity.SEV1, SATURDAY_3AM, ["phone", "sms", "im"]),
    (Severity.SEV1, TUESDAY_11AM, ["phone", "sms", "im"]),
    (Severity.SEV2, SATURDAY_3AM, ["phone", "im"]),
    (Severity.SEV2, TUESDAY_11AM, ["im", "email"]),
    (Severity.SEV3, TUESDAY_11AM, ["email"]),
    (Severity.SEV4, SATURDAY_3AM, ["email"]),
], ids=["sev1-night", "sev1-day", "sev2-night", "sev2-day", "sev3-day", "sev4-night"])
def test_routing_order_is_the_fallback_order(severity, at, expected):
    channels: dict[str, Channel] = {name: down(name) for name in ("phone", "sms", "im", "email")}
    d, _, _, _ = dispatcher(channels, attempts=1)
    route = DEFAULT_ROUTING.route(severity, at)
    attempts = d.deliver(message(severity=severity), alice(), route)
    assert route == expected and [a.channel for a in attempts] == expected


def test_sev1_at_night_pages_by_phone_then_falls_back_to_im(twilio, slack):
    """End to end on loopback: the contact has no phone, so phone and SMS fail permanently and the
    page lands in Slack; the timeline gets all three attempts."""
    cfg = config(twilio.url, slack={"webhook_url": slack.url})
    del cfg["teams"]
    d, recorded, sleeps, _ = dispatcher(build_channels(cfg))
    route = DEFAULT_ROUTING.route(Severity.SEV1, SATURDAY_3AM)
    attempts = d.deliver(message(severity="sev1"), alice(phone=None), route)
    assert summary(recorded) == [("phone", 1, "rejected"), ("sms", 1, "rejected"), ("im", 1, "sent")]
    assert recorded == attempts and sleeps == [] and len(slack.posts) == 1 and twilio.requests == []
    assert [(a.outcome, a.ok) for a in attempts][-1] == (Outcome.SENT, True)
