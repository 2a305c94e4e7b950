"""Which alert labels link an incident to Apiary jobs: only an Apiary job id (``user~name``) does;
Prometheus' own ``job`` label (the scrape job, ``apiary-node``) on node and service alerts does not."""

from __future__ import annotations

import pytest

from apiary.incidents import Links
from apiary.incidents.model import job_id_of


def test_the_scrape_job_of_a_node_alert_links_no_job():
    links = Links.from_labels({"alertname": "ApiaryGpuEccDoubleBitError", "node": "hostname-dan",
                               "job": "apiary-node", "instance": "127.0.0.1:9400"})
    assert links.jobs == () and links.nodes == ("hostname-dan",)


def test_a_job_alert_links_its_apiary_job():
    links = Links.from_labels({"alertname": "ApiaryJobLowGpuUtilization", "job": "alice~mnist", "user": "alice"})
    assert links.jobs == ("alice~mnist",) and links.users == ("alice",)
    # A relabelled scrape (no honor_labels) keeps the job id in exported_job.
    assert Links.from_labels({"job": "apiary-node", "exported_job": "bob~x"}).jobs == ("bob~x",)


@pytest.mark.parametrize("value", ["apiary-node", "", "~x", "alice~", "a~b~c", "alice"])
def test_values_that_are_not_job_ids(value):
    assert job_id_of(value) is None
