"""Real-browser helpers: headless Chromium through Selenium, and the Prefect UI's custom-run form.

Needs Debian's ``chromium`` and ``chromium-driver`` (``/usr/bin/chromium``, ``/usr/bin/chromedriver``;
``CHROME_BIN`` / ``CHROMEDRIVER`` override) and the ``selenium`` package.  :func:`chrome_driver` skips
the test when any of them is missing, except under ``CI=true``, where that is a failure.

The form helpers were checked against the self-hosted Prefect 3.8.8 UI (the Vue UI the wheel serves;
a fresh browser profile gets it, not the "V2 UI").  In that form a property is a
``div.p-label.schema-form-property`` whose header label (``span.schema-form-property__label``) is the
parameter's title, with `` (Optional)`` appended when it is not required: top-level flow parameters
show their name (``virtual_cluster``), fields of a nested pydantic model their title
(``Memory Mb``).  Its control is the first child of ``div.p-label__body > fieldset``:

* ``str``: ``textarea.p-textarea__control`` (also multi-line ``str``), or for an enum a native
  ``select.p-native-select__control`` (a second, empty ``…--placeholder`` select sits next to it);
* ``int`` / ``float``: ``input[type=number].p-number-input__control``;
* ``bool``: a toggle, ``label.p-toggle__control[role=switch]`` (its checkbox is hidden);
* ``list[...]``: ``div.schema-form-property-array-list`` with one ``div.p-draggable-list__item`` per
  item and an "Add item" button; an item of a pydantic model is a card of properties;
* ``dict``: a JSON code box (``textarea.p-code-input__textarea``); ``X | None``: a button group
  (``int`` / ``None``) above the control.

Waits poll with a deadline (:func:`wait_for`); nothing here sleeps.  Elements are located afresh for
each action, because the form re-renders a property when its value or type changes.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

import pytest
from tests.support.shared import in_ci

try:
    from selenium import webdriver
    from selenium.common.exceptions import (
        ElementClickInterceptedException,
        StaleElementReferenceException,
        TimeoutException,
    )
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.remote.webelement import WebElement
    from selenium.webdriver.support.ui import Select, WebDriverWait

    _SELENIUM_MISSING: str | None = None
except ImportError as exc:  # reported by chrome_driver(): skip, or fail under CI
    _SELENIUM_MISSING = f"selenium not importable ({exc}); pip install selenium"

T = TypeVar("T")

#: Default deadline for a UI condition (the first page load takes about 2.5 s here).
TIMEOUT_S = 30.0

_SFP = "schema-form-property"
_CONTROL = (
    "./div[contains(@class,'p-label__body')]/fieldset[contains(@class,'schema-form-property__fields')]"
    "/*[contains(@class,'schema-form-property-input') or contains(@class,'schema-form-property-kind-json')]"
)
_ITEMS = "./div[contains(@class,'p-draggable-list')]/div[contains(@class,'p-draggable-list__item')]"
_ADD_ITEM = "./div[contains(@class,'p-draggable-list')]/button[contains(@class,'p-draggable-list__create-button')]"
# The direct properties of a scope (the form, a list item, an object property) with a given label.
_FIND_PROPERTY_JS = """
const [scope, label] = arguments;
const owner = scope.closest('.schema-form-property');
for (const p of scope.querySelectorAll('.schema-form-property')) {
  if ((p.parentElement.closest('.schema-form-property')) !== owner) continue;
  const span = p.querySelector(':scope > .p-label__header .schema-form-property__label');
  const text = span ? span.textContent.trim() : null;
  if (text === label || text === label + ' (Optional)') return p;
}
return null;
"""


# --- the browser ---------------------------------------------------------------------------------


def _missing(what: str) -> NoReturn:
    if in_ci():
        pytest.fail(f"CI=true but {what}", pytrace=False)
    pytest.skip(what)


def _binary(env: str, default: str, names: Sequence[str]) -> str | None:
    if os.environ.get(env):
        return os.environ[env] if os.access(os.environ[env], os.X_OK) else None
    if os.access(default, os.X_OK):
        return default
    return next((p for p in map(shutil.which, names) if p), None)


def chrome_driver(width: int = 1400, height: int = 1000) -> WebDriver:
    """A headless Chromium WebDriver (``--headless=new --no-sandbox --disable-dev-shm-usage``).

    Skips the test when selenium, chromium or chromedriver is missing (fails it under ``CI=true``).
    The caller quits the driver (``driver.quit()``).  Starting takes about 1 s here; a browser that
    is present but will not start raises selenium's ``WebDriverException``.  Selenium Manager is never
    asked to download a driver: the Service names the installed chromedriver.
    """
    if _SELENIUM_MISSING:
        _missing(_SELENIUM_MISSING)
    chromium = _binary("CHROME_BIN", "/usr/bin/chromium", ("chromium", "chromium-browser", "google-chrome"))
    driver_path = _binary("CHROMEDRIVER", "/usr/bin/chromedriver", ("chromedriver",))
    if not chromium or not driver_path:
        _missing("chromium/chromedriver not installed (apt-get install -y chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}"):
        options.add_argument(arg)
    options.binary_location = chromium
    return webdriver.Chrome(service=Service(driver_path), options=options)


def screenshot(driver: WebDriver, artifacts: Path, name: str, full_page: bool = True) -> Path:
    """Save ``<artifacts>/<name>.png`` (and the page's HTML as ``<name>.html``); return the PNG's path.

    ``full_page`` grows the window to the page's height for the shot, then restores it.  ``name`` is
    made file-safe; ``artifacts`` is created.
    """
    artifacts.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "page"
    png = artifacts / f"{stem}.png"
    size = driver.get_window_size()
    try:
        if full_page:
            # the UI scrolls an inner container, not the document: take the tallest scroll height
            height = int(driver.execute_script(
                "return Math.max(...Array.from(document.querySelectorAll('*'), e => e.scrollHeight))") or 0)
            driver.set_window_size(size["width"], max(size["height"], min(height + 100, 8000)))
        driver.save_screenshot(str(png))
        (artifacts / f"{stem}.html").write_text(driver.page_source, encoding="utf-8")
    finally:
        if full_page:
            driver.set_window_size(size["width"], size["height"])
    return png


@contextlib.contextmanager
def screenshot_on_failure(driver: WebDriver, artifacts: Path, name: str) -> Iterator[None]:
    """On any exception inside the block (failed asserts, pytest.fail, timeouts), save a screenshot
    with :func:`screenshot` and re-raise; a screenshot that cannot be taken does not hide the error."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            screenshot(driver, artifacts, name)
        raise


def wait_for(driver: WebDriver, condition: Callable[[WebDriver], T | None], timeout_s: float = TIMEOUT_S,
             what: str = "condition", poll_s: float = 0.2) -> T:
    """``condition(driver)``'s first truthy value, polled every ``poll_s`` s (WebDriverWait; stale
    element references count as "not yet").  AssertionError "timed out after N s waiting for <what>"."""
    try:
        value = WebDriverWait(driver, timeout_s, poll_frequency=poll_s,
                              ignored_exceptions=[StaleElementReferenceException]).until(condition)
    except TimeoutException as exc:
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}") from exc
    assert value is not None  # until() returns only a truthy value
    return value


def click(driver: WebDriver, element: WebElement) -> None:
    """Scroll ``element`` to the middle of the viewport and click it (the form is taller than the
    window; a click at the edge can land on the sticky footer or a toast). When a toast lies over
    it (the UI's "Oops. Something went wrong." stays until closed), close the toasts, as a user
    would, and click once more."""
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
    try:
        element.click()
    except ElementClickInterceptedException:
        if not dismiss_toasts(driver):
            raise
        element.click()


def dismiss_toasts(driver: WebDriver) -> int:
    """Close every toast on screen with its close button; how many were closed."""
    closed = 0
    for button in driver.find_elements(By.CSS_SELECTOR, ".p-toast__close-btn"):
        with contextlib.suppress(StaleElementReferenceException, ElementClickInterceptedException):
            if button.is_displayed():
                button.click()
                closed += 1
    if closed:
        wait_for(driver, lambda d: not any(b.is_displayed() for b in d.find_elements(
            By.CSS_SELECTOR, ".p-toast__close-btn")), 10, "the toasts to close")
    return closed


def type_into(driver: WebDriver, element: WebElement, text: str) -> None:
    """Replace the value of a text area / input with ``text`` (select all, delete, type), the way a
    user does, so the UI's input events fire; ``\\n`` in a text area is a new line.  AssertionError
    when the control does not hold ``text`` afterwards."""
    click(driver, element)
    element.send_keys(Keys.CONTROL, "a")
    element.send_keys(Keys.DELETE)
    if text:
        element.send_keys(text)
    wait_for(driver, lambda _: element.get_attribute("value") == text, 5, f"the control to hold {text!r}")


# --- Prefect: the custom-run form ----------------------------------------------------------------


def log_in(driver: WebDriver, ui_url: str, auth_string: str, timeout_s: float = TIMEOUT_S) -> None:
    """Pass the Prefect UI's login page (a server with ``server.api.auth_string``): type the
    ``user:password`` into its one password field and press Login; waits until the page leaves
    /login. The UI keeps it in the browser's localStorage, so once per driver."""
    driver.get(ui_url.rstrip("/") + "/")
    field = wait_for(driver, lambda d: _clickable(d.find_elements(By.CSS_SELECTOR, "input[type=password]")),
                     timeout_s, "the Prefect UI's login field")
    type_into(driver, field, auth_string)
    click(driver, wait_for(driver, lambda d: _clickable(d.find_elements(
        By.XPATH, "//button[@type='submit'][normalize-space()='Login']")), timeout_s, "the Login button"))
    wait_for(driver, lambda d: "/login" not in d.current_url and not d.find_elements(
        By.CSS_SELECTOR, "input[type=password]"), timeout_s, "the UI past its login page")


def open_custom_run(driver: WebDriver, ui_url: str, deployment_id: str, via_menu: bool = False,
                    timeout_s: float = TIMEOUT_S) -> WebElement:
    """Open the custom-run form of a deployment and return the ``form.flow-run-create-form-v2``.

    Direct URL: ``<ui>/deployments/deployment/<id>/run``.  ``via_menu`` goes the user's way instead:
    the deployment page, its "Run" button, then "Custom run" (a link to the same page with
    ``?parameters=%257B%257D``).  Waits up to ``timeout_s`` for each step and until the parameters
    have rendered.
    """
    base = ui_url.rstrip("/")
    if via_menu:
        driver.get(f"{base}/deployments/deployment/{deployment_id}")
        run = wait_for(driver, lambda d: _clickable(d.find_elements(By.XPATH, "//button[normalize-space()='Run']")),
                       timeout_s, "the deployment's Run button")
        click(driver, run)
        item = wait_for(driver, lambda d: _clickable(d.find_elements(
            By.XPATH, "//button[contains(@class,'p-overflow-menu-item')][normalize-space()='Custom run']")),
            timeout_s, "the Custom run menu item")
        click(driver, item)
    else:
        driver.get(f"{base}/deployments/deployment/{deployment_id}/run")
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "form.flow-run-create-form-v2 .schema-form-property"),
             timeout_s, "the custom-run form")
    return driver.find_element(By.CSS_SELECTOR, "form.flow-run-create-form-v2")


def _clickable(elements: list[WebElement]) -> WebElement | None:
    return next((e for e in elements if e.is_displayed() and e.is_enabled()), None)


def form_property(driver: WebDriver, scope: WebElement, label: str) -> WebElement:
    """The property ``div.schema-form-property`` labelled ``label`` (with or without " (Optional)")
    directly in ``scope``: the form, a list item (:func:`list_items`) or an object property.
    Properties of nested objects are not searched: scope to their item or property.
    Raises LookupError when there is none (the message lists the labels there are)."""
    prop = driver.execute_script(_FIND_PROPERTY_JS, scope, label)
    if prop is None:
        labels = [e.text for e in scope.find_elements(By.CSS_SELECTOR, ".schema-form-property__label")]
        raise LookupError(f"no form property labelled {label!r} here; labels: {labels}")
    return prop  # type: ignore[no-any-return]


def property_control(prop: WebElement) -> WebElement:
    """The control of a property: the element that says its kind (``p-textarea``, ``p-select``,
    ``p-number-input``, ``p-toggle``, ``schema-form-property-array-list``,
    ``schema-form-property-object``, ``schema-form-property-kind-json``)."""
    return prop.find_element(By.XPATH, _CONTROL)


def set_text(driver: WebDriver, scope: WebElement, label: str, value: str) -> None:
    """Type ``value`` into the text property ``label`` (a ``str`` parameter; new lines allowed).
    An empty value leaves the parameter out of the run (the flow's default applies)."""
    control = property_control(form_property(driver, scope, label))
    type_into(driver, control.find_element(By.CSS_SELECTOR, "textarea"), value)


def set_number(driver: WebDriver, scope: WebElement, label: str, value: float | None) -> None:
    """Type ``value`` into the number property ``label``; None empties it (the parameter is then
    left out of the run).  The UI sends an ``int`` for an integer property."""
    control = property_control(form_property(driver, scope, label))
    type_into(driver, control.find_element(By.CSS_SELECTOR, "input[type=number]"),
              "" if value is None else str(value))


def _select_element(driver: WebDriver, scope: WebElement, label: str) -> WebElement:
    control = property_control(form_property(driver, scope, label))
    return control.find_element(By.CSS_SELECTOR,
                                "select.p-native-select__control:not(.p-native-select__control--placeholder)")


def _select(driver: WebDriver, scope: WebElement, label: str) -> Select:
    return Select(_select_element(driver, scope, label))


def select_options(driver: WebDriver, scope: WebElement, label: str) -> list[str]:
    """The values an enum property ``label`` offers (its schema's ``enum``), in order."""
    return [o.get_attribute("value") or "" for o in _select(driver, scope, label).options]


def select_value(driver: WebDriver, scope: WebElement, label: str, value: str) -> None:
    """Choose ``value`` in the enum property ``label``.  NoSuchElementException (selenium) when
    the enum has no such value."""
    element = _select_element(driver, scope, label)
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
    Select(element).select_by_value(value)
    wait_for(driver, lambda _: _select(driver, scope, label).first_selected_option.get_attribute("value") == value,
             5, f"{label} to be {value!r}")


def set_toggle(driver: WebDriver, scope: WebElement, label: str, on: bool) -> None:
    """Switch the ``bool`` property ``label`` on or off (clicks its ``label.p-toggle__control``)."""
    def toggle() -> WebElement:
        return property_control(form_property(driver, scope, label)).find_element(
            By.CSS_SELECTOR, "label.p-toggle__control")

    if (toggle().get_attribute("aria-checked") == "true") != on:
        click(driver, toggle())
    wait_for(driver, lambda _: (toggle().get_attribute("aria-checked") == "true") == on, 5, f"{label} to be {on}")


def choose_type(driver: WebDriver, scope: WebElement, label: str, type_label: str) -> None:
    """For an ``X | None`` property, press the type button ``type_label`` (``"int"``, ``"None"``…)
    above it; the property re-renders with that type's control."""
    prop = form_property(driver, scope, label)
    click(driver, prop.find_element(
        By.XPATH, f"./div[contains(@class,'p-label__body')]/div[contains(@class,'p-button-group')]"
                  f"/button[normalize-space()={_xpath_literal(type_label)}]"))
    button = f".//button[normalize-space()={_xpath_literal(type_label)}]"
    wait_for(driver, lambda _: form_property(driver, scope, label).find_element(By.XPATH, button)
             .get_attribute("aria-selected") == "true", 5, f"{label} to take type {type_label}")


def list_items(driver: WebDriver, scope: WebElement, label: str) -> list[WebElement]:
    """The items (``div.p-draggable-list__item``) of the list property ``label``, in order.  Use an
    item as the scope of its own properties when the list holds objects."""
    return property_control(form_property(driver, scope, label)).find_elements(By.XPATH, _ITEMS)


def add_list_item(driver: WebDriver, scope: WebElement, label: str) -> WebElement:
    """Press "Add item" under the list property ``label`` and return the new, last item.  An item of a
    pydantic model comes with its fields' schema defaults filled in (fields without a default, and
    ``default_factory`` ones, come empty)."""
    before = len(list_items(driver, scope, label))
    click(driver, property_control(form_property(driver, scope, label)).find_element(By.XPATH, _ADD_ITEM))
    wait_for(driver, lambda _: len(list_items(driver, scope, label)) == before + 1, 5, f"a new item in {label}")
    return list_items(driver, scope, label)[before]


def remove_list_item(driver: WebDriver, scope: WebElement, label: str, index: int) -> None:
    """Delete item ``index`` of the list property ``label`` (its trash button)."""
    before = len(list_items(driver, scope, label))
    item = list_items(driver, scope, label)[index]
    trash = "./div/div[contains(@class,'schema-form-property-array-item__control')]/button"
    click(driver, item.find_element(By.XPATH, trash))
    wait_for(driver, lambda _: len(list_items(driver, scope, label)) == before - 1, 5, f"item {index} of {label} to go")


def set_string_list(driver: WebDriver, scope: WebElement, label: str, values: Sequence[str]) -> None:
    """Make the ``list[str]`` property ``label`` hold ``values``: one text area per item, items added or
    removed (from the end) as needed."""
    while len(list_items(driver, scope, label)) > len(values):
        remove_list_item(driver, scope, label, len(list_items(driver, scope, label)) - 1)
    while len(list_items(driver, scope, label)) < len(values):
        add_list_item(driver, scope, label)
    for item, value in zip(list_items(driver, scope, label), values, strict=True):
        type_into(driver, item.find_element(By.CSS_SELECTOR, "textarea"), value)


def set_run_name(driver: WebDriver, name: str) -> None:
    """Replace the generated "Run Name" (``.flow-run-name-input input``): a name the test can find
    the run by (names are not unique: make it so)."""
    type_into(driver, driver.find_element(By.CSS_SELECTOR, "form.flow-run-create-form-v2 .flow-run-name-input input"),
              name)


def field_errors(driver: WebDriver) -> list[str]:
    """The form's inline validation messages (``.p-label__message--failed``), e.g.
    "'name' is a required property"."""
    messages = driver.find_elements(By.CSS_SELECTOR, ".p-label__message--failed")
    return [e.text.strip() for e in messages if e.text.strip()]


def toast_messages(driver: WebDriver) -> list[str]:
    """The texts of the toasts on screen (``.p-toast__message``; each lasts about 5 s)."""
    return [e.text.strip() for e in driver.find_elements(By.CSS_SELECTOR, ".p-toast__message") if e.text.strip()]


#: What the run form's toast says when the server refused the run: "Error creating flow run: …"
#: with the server's detail (a 4xx), or, when the answer carries none (a 5xx such as SQLite's
#: 503 "busy"), the UI's "Something went wrong trying to create a flow run" (FlowRunCreate.vue).
CREATE_FAILED = ("Error creating flow run", "Something went wrong trying to create a flow run")


def submit_custom_run(driver: WebDriver, timeout_s: float = TIMEOUT_S,
                      resubmit_if: Callable[[], bool] | None = None, resubmits: int = 2) -> str:
    """Press Submit and wait for the outcome; return the URL it lands on: the deployment page
    (``<ui>/deployments/deployment/<id>``; the UI appends ``?tab=Runs`` a moment later).

    AssertionError with the UI's words when the form stays put: inline messages (required
    properties, types; checked in the browser) or a :data:`CREATE_FAILED` toast (the server's
    check of the deployment's parameter schema: patterns, enums, minimum…; or a server error).
    When the server failed and ``resubmit_if()`` says the failure is one to retry (e.g. the
    server logged a 503), Submit is pressed again, as a user would, up to ``resubmits`` times;
    the form keeps its values, and a refused create leaves no run behind.
    """
    def outcome(d: WebDriver) -> str | None:
        if not d.current_url.split("?")[0].rstrip("/").endswith("/run"):
            return "ok"
        if field_errors(d) or any(m in t for t in toast_messages(d) for m in CREATE_FAILED):
            return "error"
        return None

    for attempt in range(resubmits + 1):
        driver.execute_script("document.activeElement && document.activeElement.blur()")
        click(driver, driver.find_element(By.CSS_SELECTOR, "form.flow-run-create-form-v2 button[type=submit]"))
        if wait_for(driver, outcome, timeout_s, "the custom run to be created or refused") == "ok":
            return driver.current_url
        if field_errors(driver) or attempt == resubmits or resubmit_if is None or not resubmit_if():
            break
        dismiss_toasts(driver)  # so the next outcome is the new press's
        time.sleep(2.0 * (attempt + 1))  # as a user reads the toast: the write in the way ends
    raise AssertionError(f"custom run refused: fields={field_errors(driver)} toasts={toast_messages(driver)}")


def flow_run_id_by_name(driver: WebDriver, run_name: str, timeout_s: float = TIMEOUT_S) -> str:
    """On a deployment page's Runs tab (where :func:`submit_custom_run` lands), the id of the run
    called ``run_name`` (from its ``a[href*='/runs/flow-run/']`` link).  Prefer this, or the API, to the
    toast's "View run" button, whose click is often intercepted while the toast slides in."""
    link = wait_for(driver, lambda d: _clickable(d.find_elements(
        By.XPATH, f"//a[contains(@href,'/runs/flow-run/')][normalize-space()={_xpath_literal(run_name)}]")),
        timeout_s, f"a link to flow run {run_name!r}")
    return (link.get_attribute("href") or "").rstrip("/").rsplit("/", 1)[-1]


# --- Prefect: a flow run's page ------------------------------------------------------------------


def open_flow_run(driver: WebDriver, ui_url: str, flow_run_id: str, timeout_s: float = TIMEOUT_S) -> None:
    """Open ``<ui>/runs/flow-run/<id>`` and wait up to ``timeout_s`` for its state badge."""
    driver.get(f"{ui_url.rstrip('/')}/runs/flow-run/{flow_run_id}")
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".state-badge"), timeout_s,
             "the flow run's state badge")


def state_badge(driver: WebDriver) -> str:
    """The text of the flow run page's first state badge ("Running", "Cancelled"…).  The page
    refreshes it by polling: it lags the API by up to about 5 s."""
    return driver.find_element(By.CSS_SELECTOR, ".state-badge").text.strip()


def _press_and_confirm(driver: WebDriver, button: str, confirm: str, timeout_s: float) -> None:
    press = wait_for(driver, lambda d: _clickable(d.find_elements(By.XPATH, f"//button[normalize-space()='{button}']")),
                     timeout_s, f"the {button} button")
    click(driver, press)
    ok = wait_for(driver, lambda d: _clickable(d.find_elements(
        By.XPATH, f"//div[contains(@class,'p-modal__footer')]//button[normalize-space()='{confirm}']")),
        timeout_s, f"the {button} dialog's {confirm} button")
    click(driver, ok)
    wait_for(driver, lambda d: not d.find_elements(By.CSS_SELECTOR, ".p-modal"), timeout_s,
             f"the {button} dialog to close")


def cancel_flow_run(driver: WebDriver, timeout_s: float = TIMEOUT_S) -> None:
    """On an open flow run page of a running (or scheduled) run: "Cancel", then the dialog's "Confirm".
    The API shows CANCELLING at once and CANCELLED once the runner has stopped the run."""
    _press_and_confirm(driver, "Cancel", "Confirm", timeout_s)


def retry_flow_run(driver: WebDriver, timeout_s: float = TIMEOUT_S) -> None:
    """On an open flow run page of a finished run (Completed, Failed, Cancelled…): "Retry", then the
    dialog's "Retry".  The same flow run goes to SCHEDULED "AwaitingRetry" ("Retry from the UI") and
    runs again (``run_count`` + 1) when a runner picks it up."""
    _press_and_confirm(driver, "Retry", "Retry", timeout_s)


def _xpath_literal(text: str) -> str:
    if "'" not in text:
        return f"'{text}'"
    if '"' not in text:
        return f'"{text}"'
    return "concat(" + ", \"'\", ".join(f"'{part}'" for part in text.split("'")) + ")"
