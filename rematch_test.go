package idempotency_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// counted is a handler that counts its runs and answers 201 with the run's
// number.
type counted struct{ runs int }

func (c *counted) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	c.runs++
	w.WriteHeader(http.StatusCreated)
	_, _ = w.Write([]byte{byte('0' + c.runs)})
}

func post(h http.Handler, key, contentType, body string, header ...string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(http.MethodPost, "/charges", strings.NewReader(body))
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", contentType)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

// Two versions of a service share one store during a deploy that adds a
// header to the fingerprint. With each other's lists in
// OtherFingerprintHeaders, a retry that crosses from one version to the
// other replays, in both directions; a key reused with another body still
// gets 422; without them, the crossing retry gets 422.
func TestFingerprintHeadersChangeAcrossADeploy(t *testing.T) {
	store := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	g := idempotency.New(store, idempotency.Options{})
	var h counted
	account := []string{"Stripe-Account"}
	withHeader := g.Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant,
		FingerprintHeaders: account, OtherFingerprintHeaders: [][]string{nil}})(&h)
	without := g.Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant,
		OtherFingerprintHeaders: [][]string{account}})(&h)
	const js = "application/json"

	for _, path := range []struct {
		name        string
		first, next http.Handler
	}{{"new to old", withHeader, without}, {"old to new", without, withHeader}} {
		key := "k-" + strings.ReplaceAll(path.name, " ", "-")
		runs := h.runs
		require.Equal(t, http.StatusCreated, post(path.first, key, js, `{"amount":1}`, "Stripe-Account", "acct_1").Code)
		rec := post(path.next, key, js, `{"amount":1}`, "Stripe-Account", "acct_1")
		assert.Equal(t, http.StatusCreated, rec.Code, path.name)
		assert.Equal(t, "true", rec.Header().Get(idempotency.HeaderReplayed), path.name)
		assert.Equal(t, runs+1, h.runs, "%s: runs", path.name)
		assert.Equal(t, http.StatusUnprocessableEntity, post(path.next, key, js, `{"amount":2}`, "Stripe-Account", "acct_1").Code,
			"%s: the key reused with another body", path.name)
	}

	// A record made with the header, retried with another account's: the
	// instance without the header would replay it, since it does not
	// compare the header; the one with it refuses.
	require.Equal(t, http.StatusCreated, post(withHeader, "k-account", js, `{"amount":1}`, "Stripe-Account", "acct_1").Code)
	assert.Equal(t, http.StatusUnprocessableEntity, post(withHeader, "k-account", js, `{"amount":1}`, "Stripe-Account", "acct_2").Code)

	plainNew := g.Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant, FingerprintHeaders: account})(&h)
	plainOld := g.Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant})(&h)
	require.Equal(t, http.StatusCreated, post(plainNew, "k-plain", js, `{"amount":1}`, "Stripe-Account", "acct_1").Code)
	assert.Equal(t, http.StatusUnprocessableEntity, post(plainOld, "k-plain", js, `{"amount":1}`, "Stripe-Account", "acct_1").Code,
		"a retry across versions without OtherFingerprintHeaders")
}

// A record of a form body made by the former release, which hashed form
// bodies byte for byte, is replayed to the same body; a body of other
// bytes gets 422, even one whose fields are today's equal, as the former
// release answered.
func TestFormerReleaseFormRecord(t *testing.T) {
	store := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	const form, body = "application/x-www-form-urlencoded", "amount=100&currency=eur"
	req := httptest.NewRequest(http.MethodPost, "/charges", strings.NewReader(body))
	req.Header.Set("Content-Type", form)
	k := idempotency.Key{Name: "k-form"}
	c, err := store.Claim(t.Context(), idempotency.ClaimRequest{Key: k, Fingerprint: idempotency.FormerFingerprint(req, []byte(body), nil),
		OperationID: "op_former", Lease: time.Minute, Retention: time.Hour})
	require.NoError(t, err)
	require.NoError(t, store.Complete(t.Context(), k, c.Token, idempotency.Response{Status: http.StatusCreated, Body: []byte("ch_1")}, time.Hour))

	var h counted
	guarded := idempotency.New(store, idempotency.Options{}).Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant})(&h)
	rec := post(guarded, "k-form", form, body)
	assert.Equal(t, http.StatusCreated, rec.Code)
	assert.Equal(t, "ch_1", rec.Body.String())
	assert.Equal(t, "true", rec.Header().Get(idempotency.HeaderReplayed))
	assert.Equal(t, http.StatusUnprocessableEntity, post(guarded, "k-form", form, "amount=200&currency=eur").Code)
	assert.Equal(t, http.StatusUnprocessableEntity, post(guarded, "k-form", form, "currency=eur&amount=100").Code)
	assert.Zero(t, h.runs)
}
