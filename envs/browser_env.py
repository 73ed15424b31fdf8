"""A gym-style browser environment over the bundled sites (Playwright + the OS's Chromium).

    with SiteServers() as sites, BrowserEnv(sites) as env:
        obs = env.reset(load_task(1))          # observation dict, see below
        result = env.step("stop [$120]")       # StepResult(observation, done, info, answer)
        evaluate(load_task(1), result.answer, env.url, sites, env.read_page)

Observation dict keys:
    text (str): tab list line, "URL: ..." line, then the accessibility tree (envs.observation);
        an error observation starts with "ERROR: <message>" on its own line.
    url (str): URL of the active tab.
    tabs (list[str]): titles of the open tabs, in order.
    active_tab (int): index of the active tab in `tabs`.
    screenshot (bytes | None): PNG of the active tab's viewport; None when screenshots=False.
    som_screenshot (bytes | None): with observation="som", the viewport PNG with a numbered
        box on every interactive element in view (the label is the element id); else None.
    blocked_requests (list[tuple[str, str]]): (url, resource type) of the requests blocked
        since the previous observation (see below).
    error (str | None): why the last action failed, or None.

With observation="som" (set of marks), `text` lists only the marked elements after the tab and
URL lines, `[id] role 'name'` one a line, as VisualWebArena's SoM mode does; the element ids and
actions are the same as with the accessibility tree (the default).

The browser reaches only the served sites: every request of the browser context is routed, and
one to anything but a served site's origin (or a data:, blob: or about: URL) is aborted and
logged in `env.blocked_requests`. A blocked navigation of the active tab (a link or redirect
to an outside site) gives an error observation and goes back to the page before it. Tasks with
`require_login` start signed in: `reset` posts `TEST_ACCOUNT` to each site's `login_path`.
`read_page(url, locator)` reads a page for `envs.evaluators.evaluate`'s program_html checks.

Actions (envs.actions) execute as in VisualWebArena: click and hover move the mouse to the
centre of the element's box (CDP `DOM.scrollIntoViewIfNeeded` + `DOM.getBoxModel` on the
backend node id); type focuses the element (`DOM.focus`), selects its current value so the new
text replaces it, types with the keyboard and presses Enter unless the flag is 0. Element
references `[role 'name']` resolve against the latest observation's tree (first exact match).
`goto` only reaches the served sites; it accepts placeholders and URLs relative to the page.
When an action makes the page navigate (the page's CDP session reports
`Page.frameRequestedNavigation`), the step waits for the new document to load.

`step` never raises for the agent's mistakes: an unparsable action, an unknown element or a
failing browser action give an error observation. Three consecutive parse failures or the same
action five times in a row end the episode (info["reason"]), as in VisualWebArena.
"""

import io
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urljoin

from PIL import Image
from playwright.sync_api import BrowserContext, CDPSession, Page, Route, sync_playwright
from playwright.sync_api import Error as PlaywrightError

from envs.actions import Action, ActionParseError, parse_action
from envs.lifecycle import Closing
from envs.observation import (
    AXTree,
    Mark,
    draw_marks,
    interactive_elements,
    marks_text,
    observation_text,
    render_ax_tree,
)
from envs.server import SiteServers
from envs.sites.common.accounts import TEST_ACCOUNT
from envs.tasks import Task

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-gpu",
    "--no-first-run",
]
CHROMIUM_PATHS = ("/usr/bin/chromium",)
"""Where Debian's `chromium` package puts the browser (tried first)."""
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
"""Executable names looked up on PATH after CHROMIUM_PATHS."""
MAX_PARSE_FAILURES = 3
MAX_REPEATED_ACTIONS = 5
_DOC_MARK = "__agentKvDocument"
_SELECT_CONTENTS = "function() { if (typeof this.select === 'function') this.select(); }"
OBSERVATION_MODES = ("accessibility_tree", "som")
ALLOWED_SCHEMES = ("data:", "blob:", "about:")
"""URL schemes the browser may load besides the served sites."""
_READ_VALUE = """() => {{
    let value;
    try {{ value = (
{expression}
    ); }} catch (error) {{ return ""; }}
    if (value === null || value === undefined) return "";
    if (typeof value === "string") return value;
    if (value instanceof Element) return value.innerText ?? value.textContent ?? "";
    if (value instanceof Node) return value.textContent ?? "";
    if (typeof value === "object") {{
        try {{ return JSON.stringify(value) ?? ""; }} catch (error) {{ return String(value); }}
    }}
    return String(value);
}}"""
"""Reads a program_html locator: the expression's value as a string (see `read_page`)."""


class ChromiumNotFoundError(RuntimeError):
    """No Chromium executable; the message names the fix."""


def find_chromium() -> str:
    """Path of Chromium: $AGENT_KV_CHROMIUM, else CHROMIUM_PATHS, else CHROMIUM_NAMES on PATH.

    Raises:
        ChromiumNotFoundError: none found (or $AGENT_KV_CHROMIUM is not an executable file).
    """
    configured = os.environ.get("AGENT_KV_CHROMIUM")
    if configured:
        if os.path.isfile(configured) and os.access(configured, os.X_OK):
            return configured
        raise ChromiumNotFoundError(
            f"AGENT_KV_CHROMIUM={configured} is not an executable file: "
            "point it at Chromium or unset it and run `apt-get install chromium`"
        )
    candidates = [*CHROMIUM_PATHS, *(shutil.which(name) for name in CHROMIUM_NAMES)]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise ChromiumNotFoundError(
        "Chromium not found: install it with `apt-get install chromium` "
        "or set AGENT_KV_CHROMIUM to its path"
    )


def check_observation_mode(mode: str) -> None:
    """Raises ValueError unless `mode` is one of `OBSERVATION_MODES`."""
    if mode not in OBSERVATION_MODES:
        raise ValueError(
            f"unknown observation mode {mode!r}: use one of {', '.join(OBSERVATION_MODES)}"
        )


class ActionError(Exception):
    """An action that cannot be executed on the current page; the message is for the agent."""


@dataclass
class StepResult:
    """What `BrowserEnv.step` returns.

    Attributes:
        observation: the observation dict (see the module docstring).
        done: whether the episode is over (stop, or an early-stop rule).
        info: "step" (1-based), "action" (canonical text or None), "reason" when done
            ("stop", "parse_failures", "repeated_action", "episode_over"),
            "blocked_requests" ((url, resource type) list) when the action caused any.
        answer: the stop answer when the agent stopped, else None.
    """

    observation: dict[str, Any]
    done: bool
    info: dict[str, Any] = field(default_factory=dict)
    answer: str | None = None


@dataclass
class _Tab:
    """Per-page CDP session and whether it requested a navigation during the last action."""

    cdp: CDPSession
    main_frame_id: str
    navigation_requested: bool = False


class BrowserEnv(Closing):
    """Headless Chromium over `SiteServers`, driven one text action at a time.

    Args:
        servers: the running sites (tasks' placeholders are substituted with their URLs).
        headless: run Chromium without a window.
        viewport: (width, height) in CSS pixels.
        screenshots: put a PNG of the viewport in every observation.
        timeout_s: limit for one navigation or browser call.
        observation: "accessibility_tree" (the default) or "som" (set-of-marks screenshot
            and the list of marked elements; see the module docstring).

    Attributes:
        blocked_requests: (url, resource type) of every request blocked in this episode.

    Raises:
        ValueError: an unknown `observation` mode.
        ChromiumNotFoundError: see `find_chromium`; also when the executable fails to start.
    """

    def __init__(
        self,
        servers: SiteServers,
        headless: bool = True,
        viewport: tuple[int, int] = (1280, 720),
        screenshots: bool = True,
        timeout_s: float = 10.0,
        observation: str = "accessibility_tree",
    ) -> None:
        check_observation_mode(observation)
        executable = find_chromium()
        self.servers = servers
        self.observation_mode = observation
        self.blocked_requests: list[tuple[str, str]] = []
        self._blocked_navigations: list[str] = []
        self._reported_blocked = 0
        self.viewport = viewport
        self.screenshots = screenshots
        self.timeout_ms = timeout_s * 1000
        self._playwright = sync_playwright().start()
        try:
            self._browser = self._playwright.chromium.launch(
                executable_path=executable, headless=headless, args=CHROMIUM_ARGS
            )
        except PlaywrightError as err:
            self._playwright.stop()
            reason = err.message.strip().splitlines()[0]
            raise ChromiumNotFoundError(
                f"Chromium at {executable} failed to start ({reason}): "
                "install it with `apt-get install chromium` or fix AGENT_KV_CHROMIUM"
            ) from None
        except BaseException:
            self._playwright.stop()
            raise
        self._context: BrowserContext | None = None
        self._page: Page | None = None
        self._tabs: dict[int, _Tab] = {}
        self._tree = AXTree(text="", elements={})
        self._history: list[str | None] = []
        self._parse_failures = 0
        self._done = False

    @property
    def page(self) -> Page:
        """The active tab (RuntimeError before the first reset)."""
        if self._page is None:
            raise RuntimeError("call reset(task) first")
        return self._page

    @property
    def url(self) -> str:
        """URL of the active tab."""
        return self.page.url

    @property
    def tree(self) -> AXTree:
        """The accessibility tree of the latest observation."""
        return self._tree

    def reset(self, task: Task) -> dict[str, Any]:
        """Start an episode of `task`: reset its sites, open its start URL(s), observe.

        Several start URLs (joined by ' |AND| ') open one tab each; the first is active.
        With `task.require_login`, the new browser context first signs in to each of the
        task's sites that has a `login_path` (form POST of `TEST_ACCOUNT`), so the start
        pages open with the session cookie.

        Raises:
            KeyError: a site of the task is not served by `servers`.
            RuntimeError: a login answered with an HTTP error status.
            playwright Error: a start URL cannot be loaded, or a login request fails.
        """
        self.servers.reset(task.sites)
        if self._context is not None:
            self._context.close()
        width, height = self.viewport
        self._context = self._browser.new_context(viewport={"width": width, "height": height})
        self._context.set_default_timeout(self.timeout_ms)
        self._context.route("**/*", self._route)
        self._tabs = {}
        self._history = []
        self._parse_failures = 0
        self._done = False
        self.blocked_requests = []
        self._blocked_navigations = []
        self._reported_blocked = 0
        if task.require_login:
            self._log_in(task.sites)
        for url in task.start_urls:
            page = self._context.new_page()
            page.goto(self.servers.substitute(url), wait_until="load")
        self._page = self._context.pages[0]
        self._page.bring_to_front()
        return self.observe()

    def _log_in(self, sites: list[str]) -> None:
        """Sign the browser context in to each of `sites` that has a `login_path`."""
        for name in sites:
            server = self.servers.servers[name]
            if server.spec.login_path is None:
                continue
            url = server.url + server.spec.login_path
            response = self._context.request.post(url, form=TEST_ACCOUNT)
            if not response.ok:
                raise RuntimeError(f"login to {name} at {url} failed: HTTP {response.status}")

    def _allowed(self, url: str) -> bool:
        """Whether the browser may load `url`: a served site or an ALLOWED_SCHEMES URL."""
        return url.startswith(ALLOWED_SCHEMES) or self.servers.owns(url)

    def _route(self, route: Route) -> None:
        """Context route handler: let requests to the served sites through, abort and log the
        rest."""
        request = route.request
        try:
            if self._allowed(request.url):
                route.continue_()
                return
            self.blocked_requests.append((request.url, request.resource_type))
            if request.is_navigation_request() and request.frame.parent_frame is None:
                self._blocked_navigations.append(request.url)
            route.abort("blockedbyclient")
        except PlaywrightError:
            pass  # the page or context closed while the request was pending

    def read_page(self, url: str, locator: str = "") -> str:
        """The text a program_html check reads (`envs.evaluators.evaluate`'s `read_page`).

        Args:
            url: "last" reads the active tab as it is; any other URL (placeholders are
                substituted) opens in a new tab of this context, is read, and is closed.
            locator: "" reads the page's visible text (`document.body.innerText`); otherwise
                a JavaScript expression evaluated in the page, its value stringified (null,
                undefined or a script error give "", an element its innerText, other
                objects JSON).

        Raises:
            RuntimeError: called before `reset`.
            ValueError: `url` is not on a served site.
            playwright Error: the page cannot be loaded.
        """
        if url == "last":
            return self._read(self.page, locator)
        url = self.servers.substitute(url)
        if not self.servers.owns(url):
            sites = ", ".join(self.servers.urls.values())
            raise ValueError(f"program_html url {url} is not on a served site ({sites})")
        if self._context is None:
            raise RuntimeError("call reset(task) first")
        page = self._context.new_page()
        try:
            page.goto(url, wait_until="load")
            return self._read(page, locator)
        finally:
            page.close()
            self.page.bring_to_front()

    @staticmethod
    def _read(page: Page, locator: str) -> str:
        """`document.body.innerText` for an empty locator, else the expression's value."""
        expression = locator.strip() or "document.body.innerText"
        try:
            return page.evaluate(_READ_VALUE.format(expression=expression))
        except PlaywrightError:
            return ""  # the expression does not parse

    def observe(self, error: str | None = None) -> dict[str, Any]:
        """The observation of the active tab now (with `error` when the last action failed)."""
        page = self.page
        tab = self._tab(page)
        self._tree = render_ax_tree(tab.cdp.send("Accessibility.getFullAXTree")["nodes"])
        pages = self._context.pages
        titles = [p.title() for p in pages]
        active = pages.index(page)
        screenshot = som_screenshot = None
        if self.screenshots or self.observation_mode == "som":
            screenshot = page.screenshot(type="png")
        if self.observation_mode == "som":
            marks = self.marks(screenshot)
            som_screenshot = draw_marks(screenshot, marks)
            tree = AXTree(text=marks_text(marks), elements=self._tree.elements)
            text = observation_text(titles, active, page.url, tree)
        else:
            text = observation_text(titles, active, page.url, self._tree)
        if error is not None:
            text = f"ERROR: {error}\n{text}"
        blocked = self.blocked_requests[self._reported_blocked :]
        self._reported_blocked = len(self.blocked_requests)
        return {
            "text": text,
            "url": page.url,
            "tabs": titles,
            "active_tab": active,
            "screenshot": screenshot if self.screenshots else None,
            "som_screenshot": som_screenshot,
            "blocked_requests": blocked,
            "error": error,
        }

    def marks(self, screenshot: bytes | None = None) -> list[Mark]:
        """Set-of-marks boxes of the latest observation's interactive elements that are in
        the active tab's viewport, in reading order; boxes (CDP `DOM.getBoxModel` border
        quads, clipped to the viewport) are in the pixels of `screenshot` (CSS pixels when
        None). Elements without a box (hidden) or wholly outside the viewport are left out.
        """
        width, height = self.viewport
        scale = 1.0
        if screenshot is not None:
            scale = Image.open(io.BytesIO(screenshot)).width / width
        tab = self._tab(self.page)
        marks: list[Mark] = []
        for element in interactive_elements(self._tree):
            try:
                model = tab.cdp.send("DOM.getBoxModel", {"backendNodeId": element.id})["model"]
            except PlaywrightError:
                continue
            xs, ys = model["border"][0::2], model["border"][1::2]
            left, top = max(min(xs), 0), max(min(ys), 0)
            right, bottom = min(max(xs), width), min(max(ys), height)
            if right - left < 1 or bottom - top < 1:
                continue
            box = (left * scale, top * scale, right * scale, bottom * scale)
            marks.append(Mark(element=element, box=box))
        return marks

    def reject(self, error: str) -> StepResult:
        """Count a reply that is no action as the step: the page stays, and the observation
        carries `error` (what `step` does with text `parse_action` refuses; an agent that
        writes actions in another format calls it with that format's own message). After
        `MAX_PARSE_FAILURES` in a row the episode ends with reason "parse_failures"."""
        step = len(self._history) + 1
        self._history.append(None)
        self._parse_failures += 1
        info: dict[str, Any] = {"step": step, "action": None}
        if self._parse_failures >= MAX_PARSE_FAILURES:
            self._done = True
            info["reason"] = "parse_failures"
        return StepResult(self.observe(error=error), self._done, info)

    def step(self, action_text: str) -> StepResult:
        """Parse and execute one action; see the module docstring for errors and early stops."""
        step = len(self._history) + 1
        if self._done:
            observation = self.observe(error="the episode is over; call reset(task)")
            return StepResult(
                observation, True, {"step": step, "action": None, "reason": "episode_over"}
            )
        try:
            action = parse_action(action_text)
        except ActionParseError as parse_error:
            return self.reject(str(parse_error))
        self._parse_failures = 0
        self._history.append(str(action))
        info = {"step": step, "action": str(action)}
        if action.kind == "stop":
            self._done = True
            info["reason"] = "stop"
            return StepResult(self.observe(), True, info, answer=action.answer)
        error = None
        blocked_before = len(self.blocked_requests)
        navigations_before = len(self._blocked_navigations)
        try:
            self._execute(action)
        except ActionError as action_error:
            error = str(action_error)
        except PlaywrightError as browser_error:
            error = f"{action} failed: {browser_error.message.splitlines()[0]}"
        if len(self._blocked_navigations) > navigations_before:
            error = self._undo_blocked_navigation(self._blocked_navigations[-1])
        if len(self.blocked_requests) > blocked_before:
            info["blocked_requests"] = self.blocked_requests[blocked_before:]
        recent = self._history[-MAX_REPEATED_ACTIONS:]
        if len(recent) == MAX_REPEATED_ACTIONS and len(set(recent)) == 1:
            self._done = True
            info["reason"] = "repeated_action"
        return StepResult(self.observe(error=error), self._done, info)

    def _undo_blocked_navigation(self, url: str) -> str:
        """After a blocked navigation: leave the error page the tab shows (go back) and
        return the error message for the agent."""
        page = self.page
        if page.url.startswith("chrome-error:"):
            try:
                page.go_back(wait_until="load")
            except PlaywrightError:
                pass  # the observation shows where the tab is
        sites = ", ".join(self.servers.urls.values())
        return f"{url} is blocked: the browser only reaches the local sites ({sites})"

    def resolve(self, action: Action) -> Action:
        """`action` with an `[role 'name']` element reference replaced by the element's id.

        Raises:
            ActionError: no element with that role and name in the latest observation.
        """
        if action.element_ref is None:
            return action
        element = self._tree.find(action.element_ref.role, action.element_ref.name)
        if element is None:
            raise ActionError(f"no element [{action.element_ref}] on the current page")
        return replace(action, element_id=element.id, element_ref=None)

    def concrete_action(self, action_text: str) -> str:
        """The canonical text of an action with element references resolved to current ids,
        e.g. "click [link 'Home']" -> "click [15]" (what a model would have to emit).

        Raises:
            ActionParseError: the text does not parse.
            ActionError: a reference matches no element of the latest observation.
        """
        return str(self.resolve(parse_action(action_text)))

    def _tab(self, page: Page) -> _Tab:
        """The CDP session of `page`, created on first use."""
        key = id(page)
        if key not in self._tabs:
            cdp = self._context.new_cdp_session(page)
            frame_id = cdp.send("Page.getFrameTree")["frameTree"]["frame"]["id"]
            tab = _Tab(cdp=cdp, main_frame_id=frame_id)

            def on_request(event: dict) -> None:
                if event.get("frameId") == tab.main_frame_id:
                    tab.navigation_requested = True

            cdp.on("Page.frameRequestedNavigation", on_request)
            cdp.send("Page.enable")
            self._tabs[key] = tab
        return self._tabs[key]

    def _element_id(self, action: Action) -> int:
        """The backend node id the action targets, checked against the latest observation."""
        element_id = self.resolve(action).element_id
        if element_id not in self._tree.elements:
            raise ActionError(
                f"no element with id [{element_id}] on the current page; "
                "use an id shown in brackets in the observation"
            )
        return element_id

    def _centre(self, tab: _Tab, backend_id: int) -> tuple[float, float]:
        """Viewport coordinates of the centre of the element's box, scrolled into view."""
        try:
            tab.cdp.send("DOM.scrollIntoViewIfNeeded", {"backendNodeId": backend_id})
            quad = tab.cdp.send("DOM.getBoxModel", {"backendNodeId": backend_id})["model"]
        except PlaywrightError:
            raise ActionError(f"element [{backend_id}] is not visible on the page") from None
        xs, ys = quad["content"][0::2], quad["content"][1::2]
        return sum(xs) / 4, sum(ys) / 4

    def _execute(self, action: Action) -> None:
        """Run one non-stop action in the browser."""
        page = self.page
        match action.kind:
            case "click" | "hover":
                backend_id = self._element_id(action)
                tab = self._tab(page)
                x, y = self._centre(tab, backend_id)
                if action.kind == "hover":
                    page.mouse.move(x, y)
                else:
                    self._maybe_navigating(page, lambda: page.mouse.click(x, y))
            case "type":
                backend_id = self._element_id(action)
                self._type(page, backend_id, action.text or "", action.press_enter)
            case "press":
                self._maybe_navigating(page, lambda: page.keyboard.press(action.key))
            case "scroll":
                sign = -1 if action.direction == "up" else 1
                page.evaluate("(sign) => window.scrollBy(0, sign * window.innerHeight)", sign)
            case "new_tab":
                self._page = self._context.new_page()
            case "tab_focus":
                pages = self._context.pages
                if not 0 <= action.tab_index < len(pages):
                    raise ActionError(
                        f"no tab {action.tab_index}: open tabs are 0-{len(pages) - 1}"
                    )
                self._page = pages[action.tab_index]
                self._page.bring_to_front()
            case "close_tab":
                self._tabs.pop(id(page), None)
                page.close()
                pages = self._context.pages
                self._page = pages[-1] if pages else self._context.new_page()
                self._page.bring_to_front()
            case "goto":
                url = urljoin(page.url, self.servers.substitute(action.url))
                if not self.servers.owns(url):
                    sites = ", ".join(self.servers.urls.values())
                    raise ActionError(f"goto is limited to the local sites ({sites}): {url}")
                page.goto(url, wait_until="load")
            case "go_back":
                page.go_back(wait_until="load")
            case "go_forward":
                page.go_forward(wait_until="load")
        opened = self._context.pages
        if self._page not in opened:
            self._page = opened[-1]

    def _type(self, page: Page, backend_id: int, text: str, press_enter: bool) -> None:
        """Focus the element, select its contents, type `text`, then Enter if asked."""
        tab = self._tab(page)
        try:
            tab.cdp.send("DOM.focus", {"backendNodeId": backend_id})
        except PlaywrightError:
            raise ActionError(f"element [{backend_id}] cannot take text input") from None
        node = tab.cdp.send("DOM.resolveNode", {"backendNodeId": backend_id})["object"]
        tab.cdp.send(
            "Runtime.callFunctionOn",
            {"objectId": node["objectId"], "functionDeclaration": _SELECT_CONTENTS},
        )
        tab.cdp.send("Runtime.releaseObject", {"objectId": node["objectId"]})
        page.keyboard.type(text)
        if press_enter:
            self._maybe_navigating(page, lambda: page.keyboard.press("Enter"))

    def _maybe_navigating(self, page: Page, act: Callable[[], None]) -> None:
        """Run `act` (a zero-argument callable); if it made the page navigate, wait for load.

        The document is marked before acting; after a round trip on the page's CDP session
        (which delivers events sent before it), a requested navigation means waiting until
        a new, fully loaded document (one without the mark) is there.
        """
        tab = self._tab(page)
        page.evaluate(f"() => {{ window.{_DOC_MARK} = true; }}")
        tab.navigation_requested = False
        act()
        tab.cdp.send("Page.enable")
        if tab.navigation_requested:
            page.wait_for_function(
                f"() => !window.{_DOC_MARK} && document.readyState === 'complete'",
                polling=20,
                timeout=self.timeout_ms,
            )

    def close(self) -> None:
        """Close the browser and Playwright; safe to call twice."""
        if self._playwright is None:
            return
        try:
            self._browser.close()
        finally:
            self._playwright.stop()
            self._playwright = None
            self._page = None
