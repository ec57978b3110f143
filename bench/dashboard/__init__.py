"""The dashboard at fleet scale in headless Chromium: bytes per update and first-render time.

A coordinator in this process, never started (no Kafka), fed a synthetic fleet
(:mod:`tests.fleet_at_scale`: 1,000 workers, 50 reload rollouts pinned to all of them, the last
five in progress), its API served by uvicorn on a free port. While the page is open the feed
goes on: every worker's heartbeat every 3 s, and every second ten more workers of each rollout
in progress succeed (their heartbeats then report its version), so rollouts, counts and the
version histogram change as they would during a real rollout.

Headless Chromium (Debian's ``chromium`` + ``chromium-driver``, Selenium; see
tests/browser/chrome.py) loads the dashboard; DevTools' performance log (Network.*) counts
every byte the page receives: responses (``Network.loadingFinished``, headers included) and
the event stream's chunks (``Network.dataReceived`` of a request still open). A script added
before the page's own marks when ``<html data-ready="1">`` appears (first render, from
navigation start) and each change of ``data-updates``. Reported:

- **bytes per update after the first**: what the page received after its first render, over
  the updates it applied meanwhile (mean), and the most received between two updates (max);
- **first render**: navigation start to ``data-ready="1"``, over several loads (the browser
  has navigated once before, to ``/healthz``: starting its renderer is not the page's cost);
- **baseline**, measured in the same run against the same server: one full poll of
  ``/api/v1/rollouts`` + ``/api/v1/workers`` (every page, bytes with headers), what a
  dashboard polling the lists downloads at each refresh, and every rollout with its workers
  (``/api/v1/rollouts/{id}`` for each: the issue's dashboard, every 1.5 s); the ratios.

Targets (issue 15): < 100 KB per update after the first, first render < 1 s.

    .venv/bin/python -m bench.dashboard --quick     # 300 workers x 15 rollouts, 1 load (~1 min)
    .venv/bin/python -m bench.dashboard             # 1,000 workers x 50 rollouts, 5 loads
"""
