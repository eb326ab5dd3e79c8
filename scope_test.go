package idempotency_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/assert"
)

// A Scope that names no account (the header it reads is missing) is
// refused with 400, so that such requests never share one scope; only
// SingleTenant serves the empty scope.
func TestMiddlewareRefusesEmptyScope(t *testing.T) {
	g := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	runs := 0
	handler := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { runs++; w.WriteHeader(http.StatusCreated) })
	send := func(scope func(*http.Request) (string, error), account string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/charges", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "k1")
		if account != "" {
			req.Header.Set("X-Account-ID", account)
		}
		rec := httptest.NewRecorder()
		g.Middleware(idempotency.MiddlewareOptions{Scope: scope})(handler).ServeHTTP(rec, req)
		return rec
	}
	accountOf := func(r *http.Request) (string, error) { return r.Header.Get("X-Account-ID"), nil }

	rec := send(accountOf, "")
	assert.Equal(t, http.StatusBadRequest, rec.Code)
	assert.Contains(t, rec.Body.String(), `"code":"unknown-scope"`)
	assert.Zero(t, runs, "runs of a request that names no account")
	assert.Equal(t, http.StatusCreated, send(accountOf, "acct_1").Code)
	assert.Equal(t, http.StatusCreated, send(idempotency.SingleTenant, "").Code)
	assert.Equal(t, 2, runs)
}
