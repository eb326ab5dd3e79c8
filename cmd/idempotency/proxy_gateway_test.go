package main

import (
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// send sends req and reads its answer whole.
func send(t *testing.T, req *http.Request) answer {
	t.Helper()
	resp, err := noRedirects.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return answer{resp.StatusCode, resp.Header, string(b)}
}

// TestProxyForwarded: behind a gateway that ends TLS, with
// -trust-forwarded, the upstream sees the scheme and host the client used
// at the gateway, so that a Rails or Django app that insists on https
// answers instead of redirecting; without it, a client's forwarding
// headers are replaced by the proxy's own view, whatever their spelling.
func TestProxyForwarded(t *testing.T) {
	s := stores(t)["redis"](t)
	u := startUpstream(t)
	trusting, plain := startProxy(t, s.flags, u, "-trust-forwarded"), startProxy(t, s.flags, u)
	gateway := []string{"X-Forwarded-Proto", "https", "X-Forwarded-Host", "api.example.com",
		"X-Forwarded-For", "203.0.113.7"}

	c := decodeCharge(t, post(t, trusting.url, "/secure", "acct_1", "fwd-1", `{}`, gateway...))
	assert.Equal(t, "https", c.Seen["X-Forwarded-Proto"])
	assert.Equal(t, "api.example.com", c.Seen["X-Forwarded-Host"])
	assert.Equal(t, "203.0.113.7, 127.0.0.1", c.Seen["X-Forwarded-For"])

	forged := append(gateway, "X-Forwarded-Port", "443", "X-Forwarded-Ssl", "on", "X_Forwarded_Proto", "https")
	a := post(t, plain.url, "/secure", "acct_1", "fwd-2", `{}`, forged...)
	assert.Equal(t, http.StatusMovedPermanently, a.status, "an untrusted client's X-Forwarded-Proto counted")
	host := strings.TrimPrefix(plain.url, "http://")
	assert.Equal(t, "https://"+host+"/secure", a.header.Get("Location"))

	c = decodeCharge(t, post(t, plain.url, "/charges", "acct_1", "fwd-3", `{}`, forged...))
	assert.Equal(t, "http", c.Seen["X-Forwarded-Proto"])
	assert.Equal(t, host, c.Seen["X-Forwarded-Host"])
	assert.Equal(t, "127.0.0.1", c.Seen["X-Forwarded-For"])
	assert.Empty(t, c.Seen["X-Forwarded-Port"])
	assert.Empty(t, c.Seen["X-Forwarded-Ssl"])
	assert.Equal(t, []string{"http"}, c.Environ["HTTP_X_FORWARDED_PROTO"])
}

// TestProxyUnderscoreAliases: a client's operation, key, scope and
// forwarding headers spelled with "_" for "-", in any case, never reach
// the upstream, where Rack and WSGI would read them as the proxy's own.
func TestProxyUnderscoreAliases(t *testing.T) {
	s := stores(t)["redis"](t)
	u := startUpstream(t)
	p := startProxy(t, s.flags, u)
	req, err := http.NewRequest(http.MethodPost, p.url+"/charges", strings.NewReader(`{}`))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "alias-1")
	req.Header.Set("X-Account-ID", "acct_1")
	for name, v := range map[string]string{
		"Idempotency_Operation_Key": "forged", "idempotency_fencing_token": "999999",
		"IDEMPOTENCY_ATTEMPT": "9", "Idempotency_Key": "alias-2", "x_account_id": "acct_victim",
		"X_Forwarded_For": "10.0.0.1",
	} {
		req.Header[name] = []string{v} // sent as spelt
	}
	var c charge
	a := send(t, req)
	require.Equal(t, http.StatusCreated, a.status, a.body)
	require.NoError(t, json.Unmarshal([]byte(a.body), &c))
	op, _ := u.operation(t, "acct_1", "alias-1")
	assert.Equal(t, []string{op}, c.Environ["HTTP_IDEMPOTENCY_OPERATION_KEY"])
	assert.Equal(t, []string{c.Seen["Idempotency-Fencing-Token"]}, c.Environ["HTTP_IDEMPOTENCY_FENCING_TOKEN"])
	assert.NotEqual(t, "999999", c.Seen["Idempotency-Fencing-Token"])
	assert.Equal(t, []string{"1"}, c.Environ["HTTP_IDEMPOTENCY_ATTEMPT"])
	assert.Equal(t, []string{"alias-1"}, c.Environ["HTTP_IDEMPOTENCY_KEY"])
	assert.Equal(t, []string{"acct_1"}, c.Environ["HTTP_X_ACCOUNT_ID"])
	assert.Equal(t, []string{"127.0.0.1"}, c.Environ["HTTP_X_FORWARDED_FOR"])
}

// TestProxyMethodsAnyCase: -methods names methods in any case, and guards
// them; an unknown one is refused at start.
func TestProxyMethodsAnyCase(t *testing.T) {
	s := stores(t)["redis"](t)
	u := startUpstream(t)
	p := startProxy(t, s.flags, u, "-methods", "post,patch")
	first := decodeCharge(t, post(t, p.url, "/charges", "acct_1", "lower-1", `{"amount":5}`))
	again := post(t, p.url, "/charges", "acct_1", "lower-1", `{"amount":5}`)
	assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
	assert.Equal(t, first.ID, decodeCharge(t, again).ID)
	_, calls := u.operation(t, "acct_1", "lower-1")
	assert.Equal(t, 1, calls, "upstream calls for two POSTs with one key")

	code, _, stderr := command(t, "", "-redis", "redis://127.0.0.1:1", "proxy", "-single-tenant",
		"-upstream", "http://127.0.0.1:1", "-methods", "post,pots")
	assert.Equal(t, 2, code)
	assert.Contains(t, stderr, `unknown method "pots"`)
}

// TestProxyNoTransportRetry: a guarded POST without a body reaches the
// upstream once per attempt, even when the upstream drops a reused
// connection after reading it. http.Transport would resend such a request,
// carrying an Idempotency-Key, on a new connection: one attempt, and its
// side effect, twice.
func TestProxyNoTransportRetry(t *testing.T) {
	s := stores(t)["redis"](t)
	u := startPython(t, "testdata/rawupstream.py")
	p := startProxy(t, s.flags, u)
	assert.Equal(t, http.StatusCreated, post(t, p.url, "/charges", "acct_1", "empty-1", "").status)
	dropped := post(t, p.url, "/charges", "acct_1", "empty-2", "")
	assert.Equal(t, http.StatusBadGateway, dropped.status, "the upstream dropped the connection under the request")
	assert.Equal(t, 1, rawReceived(t, u, "empty-1"))
	assert.Equal(t, 1, rawReceived(t, u, "empty-2"), "requests the upstream received for one attempt")
}

// rawReceived is how many requests testdata/rawupstream.py received with key.
func rawReceived(t *testing.T, u upstream, key string) int {
	t.Helper()
	resp, err := http.Get(u.url + "/_count?key=" + url.QueryEscape(key))
	require.NoError(t, err)
	defer resp.Body.Close()
	var n struct{ Received int }
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&n))
	return n.Received
}
