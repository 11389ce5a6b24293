"""POST /v1/budgets/{name} keeps what it does not name and names what it does not know (issue 30,
item 3), against a real ``privalign serve`` on loopback."""

from .test_server import ADMIN, STUB, Server, call


def test_the_documented_raise_keeps_every_field_it_does_not_name(tmp_path):
    # the docs' curl ({"epsilon_total": 20, ...}) on a zcdp budget like the example config's
    srv = Server(tmp_path, STUB.format(total=10.0).replace('composition = "fsrc"', 'composition = "zcdp"')
                 .replace("delta_total = 0.9", "delta_total = 1e-6"))
    srv.start()
    try:
        status, b = call(srv.url, "/v1/budgets/acme-rm", {"epsilon_total": 20}, key=ADMIN)
        assert status == 200, b
        assert (b["epsilon_total"], b["delta_total"], b["composition"], b["tenant"]) == (20.0, 1e-6, "zcdp", "acme")
        status, err = call(srv.url, "/v1/budgets/acme-rm", {"epsilon_totl": 30}, key=ADMIN)
        assert status == 400 and err["error"]["param"] == "epsilon_totl" and "'epsilon_total'" in err["error"]["message"]
        status, err = call(srv.url, "/v1/budgets/acme-rm", {"tenant": "globex"}, key=ADMIN)
        assert status == 400 and err["error"]["param"] == "tenant"
        status, err = call(srv.url, "/v1/budgets/new-rm", {"tenant": "acme"}, key=ADMIN)
        assert status == 400 and err["error"]["param"] == "epsilon_total"
        assert call(srv.url, "/v1/budgets/acme-rm", key=ADMIN)[1]["epsilon_total"] == 20.0  # refusals changed nothing
    finally:
        srv.stop()
