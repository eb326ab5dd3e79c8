package idempotency_test

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// MiddlewareOptions.Stored keeps less than the handler wrote: the first
// client gets the response whole, the record and every replay get what
// Stored kept, marked with Idempotent-Body-Omitted; the secret is nowhere
// in the store.
func TestMiddlewareStoresLess(t *testing.T) {
	const secret = "sk_live_4eC39HqLyjWDarjtT1zdp7dc"
	redact := func(_ *http.Request, resp idempotency.Response) (idempotency.Response, string) {
		resp.Body = bytes.ReplaceAll(resp.Body, []byte(secret), []byte("[redacted]"))
		resp.Header.Del("X-Api-Key")
		return resp, "redacted"
	}
	for _, c := range []struct {
		name     string
		stored   func(*http.Request, idempotency.Response) (idempotency.Response, string)
		omitted  string
		replayed string
	}{
		{"redacted", redact, "redacted", `{"api_key":"[redacted]"}`},
		{"body omitted", idempotency.OmitBody, "omitted", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			store := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
			h := idempotency.New(store, idempotency.Options{}).Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant, Stored: c.stored})(
				http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
					w.Header().Set("X-Api-Key", secret)
					w.Header().Set("Content-Type", "application/json")
					w.WriteHeader(http.StatusCreated)
					_, _ = w.Write([]byte(`{"api_key":"` + secret + `"}`))
				}))
			send := func() *httptest.ResponseRecorder {
				req := httptest.NewRequest(http.MethodPost, "/api-keys", strings.NewReader(`{}`))
				req.Header.Set("Idempotency-Key", "k1")
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, req)
				return rec
			}
			first := send()
			require.Equal(t, http.StatusCreated, first.Code)
			assert.Contains(t, first.Body.String(), secret, "the first client's body")
			assert.Equal(t, secret, first.Header().Get("X-Api-Key"), "the first client's header")
			assert.Empty(t, first.Header().Get(idempotency.HeaderBodyOmitted))

			replay := send()
			require.Equal(t, http.StatusCreated, replay.Code)
			assert.Equal(t, "true", replay.Header().Get(idempotency.HeaderReplayed))
			assert.Equal(t, c.omitted, replay.Header().Get(idempotency.HeaderBodyOmitted))
			assert.Equal(t, c.replayed, replay.Body.String())
			assert.Equal(t, "application/json", replay.Header().Get("Content-Type"))

			rec, err := store.Inspect(t.Context(), idempotency.Key{Name: "k1"})
			require.NoError(t, err)
			assert.Equal(t, len(c.replayed), rec.BodySize, "the stored body's size")
			assert.Equal(t, c.name == "body omitted", slices.Contains(rec.HeaderNames, "X-Api-Key"), "the stored header names %v", rec.HeaderNames)
		})
	}
}
