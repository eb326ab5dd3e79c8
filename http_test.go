package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/storeerr"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// storeCase is a Store the middleware tests run against.
type storeCase struct {
	name string
	new  func(t *testing.T) Store // a fresh, empty store
}

// stores lists the stores every middleware test runs against: one line per
// store.
func stores() []storeCase {
	return []storeCase{
		{"memory", func(*testing.T) Store { return NewMemoryStore(MemoryOptions{}) }},
		{"miniredis", func(t *testing.T) Store {
			c := redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr()})
			t.Cleanup(func() { c.Close() })
			return newRedisStore(t, c)
		}},
		{"redis-server", func(t *testing.T) Store { return newRedisStore(t, testserver.StartRedis(t).Client()) }},
	}
}

func eachStore(t *testing.T, test func(t *testing.T, newStore func(*testing.T) Store)) {
	for _, sc := range stores() {
		t.Run(sc.name, func(t *testing.T) { test(t, sc.new) })
	}
}

// faultStore runs hook before each call to Store, with the call's context;
// an error from it is the call's.
type faultStore struct {
	Store
	hook func(ctx context.Context, op string) error
}

func (f *faultStore) Claim(ctx context.Context, req ClaimRequest) (Claim, error) {
	if err := f.hook(ctx, "claim"); err != nil {
		return Claim{}, err
	}
	return f.Store.Claim(ctx, req)
}

func (f *faultStore) Complete(ctx context.Context, k Key, token uint64, resp Response, retention time.Duration) error {
	if err := f.hook(ctx, "complete"); err != nil {
		return err
	}
	return f.Store.Complete(ctx, k, token, resp, retention)
}

func (f *faultStore) Release(ctx context.Context, k Key, token uint64) error {
	if err := f.hook(ctx, "release"); err != nil {
		return err
	}
	return f.Store.Release(ctx, k, token)
}

func (f *faultStore) Forget(ctx context.Context, k Key, token uint64) error {
	if err := f.hook(ctx, "forget"); err != nil {
		return err
	}
	return f.Store.Forget(ctx, k, token)
}

func (f *faultStore) Abandon(ctx context.Context, k Key, token uint64) error {
	if err := f.hook(ctx, "abandon"); err != nil {
		return err
	}
	return f.Store.Abandon(ctx, k, token)
}

func (f *faultStore) Heartbeat(ctx context.Context, k Key, token uint64, lease time.Duration) error {
	if err := f.hook(ctx, "heartbeat"); err != nil {
		return err
	}
	return f.Store.Heartbeat(ctx, k, token, lease)
}

func (f *faultStore) Subscribe(ctx context.Context, k Key) (Subscription, error) {
	if err := f.hook(ctx, "subscribe"); err != nil {
		return nil, err
	}
	return f.Store.Subscribe(ctx, k)
}

// failOn returns a hook that fails the named operations with err.
func failOn(err error, ops ...string) func(context.Context, string) error {
	return func(_ context.Context, op string) error {
		for _, o := range ops {
			if o == op {
				return err
			}
		}
		return nil
	}
}

var errInjected = errors.New("injected failure")

// hdr builds a header from name, value pairs; a name may repeat.
func hdr(kv ...string) http.Header {
	h := http.Header{}
	for i := 0; i < len(kv); i += 2 {
		h.Add(kv[i], kv[i+1])
	}
	return h
}

const problemBase = `{"type":"https://github.com/idempotency-go/idempotency/blob/main/docs/errors.md#`

// problemBody is the problem+json body of the problem code, as the default
// ProblemDetails writes it.
func problemBody(code, title string, status int, detail string) string {
	return fmt.Sprintf(`%s%s","title":%q,"status":%d,"detail":%q,"code":%q}`, problemBase, code, title, status, detail, code)
}

var (
	bodyMissingKey  = problemBody("missing-key", "Idempotency-Key required", 400, "This request must carry an Idempotency-Key header.")
	bodyKeyRepeated = problemBody("repeated-key", "Idempotency-Key repeated", 400, "The Idempotency-Key header must be sent exactly once.")
	bodyInvalidKey  = problemBody("invalid-key", "Invalid Idempotency-Key", 400, "The Idempotency-Key must be 1 to 255 visible ASCII characters, bare or as a quoted string.")
	bodyScope       = problemBody("unknown-scope", "Request scope unknown", 400, "The request does not identify the account its Idempotency-Key belongs to.")
	bodyTooLarge8   = problemBody("body-too-large", "Request body too large", 413, "The request body exceeds 8 bytes.")
	bodyUnreadable  = problemBody("unreadable-body", "Request body unreadable", 400, "The request body could not be read.")
	bodyMismatch    = problemBody("key-reused", "Idempotency-Key reused", 422, "This Idempotency-Key was used before with a different request.")
	bodyInFlight    = problemBody("in-flight", "Request in progress", 409, "A request with this Idempotency-Key is still in progress; retry later with the same key.")
	bodyFenced      = problemBody("outcome-not-recorded", "Outcome not recorded", 503, "This attempt lost its hold on the Idempotency-Key before its outcome was recorded; retry with the same key.")
	bodyUnavailable = problemBody("store-unavailable", "Idempotency store unavailable", 503, "The outcome of this request could not be looked up or recorded; retry later with the same key.")
)

var (
	problemHeader = hdr("Content-Type", "application/problem+json", "Cache-Control", "no-store")
	retryHeader   = hdr("Content-Type", "application/problem+json", "Cache-Control", "no-store", "Retry-After", "1")
	createdHeader = hdr("Content-Type", "text/plain")
	replayHeader  = hdr("Content-Type", "text/plain", HeaderReplayed, "true")
)

// echo is the default handler of the table: 201 with the run number, the
// method, the content length and the body it read.
func echo(w http.ResponseWriter, r *http.Request, run int64) {
	b, err := io.ReadAll(r.Body)
	if err != nil {
		panic(err)
	}
	w.Header().Set("Content-Type", "text/plain")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, "run %d: %s %d %s", run, r.Method, r.ContentLength, b)
}

// statusHandler answers status with a body naming the run.
func statusHandler(status int) func(http.ResponseWriter, *http.Request, int64) {
	return func(w http.ResponseWriter, _ *http.Request, run int64) {
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(status)
		fmt.Fprintf(w, "status %d run %d", status, run)
	}
}

// call is one request of a table row and the exact response it must get.
type call struct {
	method  string            // default POST
	keys    []string          // Idempotency-Key field lines
	body    string            // sent with a Content-Length
	chunked bool              // send body without a Content-Length
	header  map[string]string // more request fields
	status  int
	want    http.Header
	resp    string
}

func post(key, body string, status int, want http.Header, resp string) call {
	return call{keys: []string{key}, body: body, status: status, want: want, resp: resp}
}

func (c call) request() *http.Request {
	method := c.method
	if method == "" {
		method = http.MethodPost
	}
	var body io.Reader = strings.NewReader(c.body)
	if c.chunked {
		body = io.MultiReader(body) // hides the length
	}
	r := httptest.NewRequest(method, "/charges", body)
	for _, k := range c.keys {
		r.Header.Add(HeaderKey, k)
	}
	for name, v := range c.header {
		r.Header.Set(name, v)
	}
	return r
}

type row struct {
	name    string
	opts    MiddlewareOptions
	fault   func(ctx context.Context, op string) error
	handler func(w http.ResponseWriter, r *http.Request, run int64) // default echo
	calls   []call
	runs    int64 // how many times the handler must have run
}

func TestMiddlewareContract(t *testing.T) { eachStore(t, middlewareContract) }

// middlewareContract runs the contract's rows, each on a fresh store from
// newStore.
func middlewareContract(t *testing.T, newStore func(*testing.T) Store) {
	longKey := strings.Repeat("k", MaxKeyLength)
	rows := []row{
		{
			name: "unguarded methods pass through",
			calls: []call{
				{method: http.MethodGet, keys: []string{"k"}, status: 201, want: createdHeader, resp: "run 1: GET 0 "},
				{method: http.MethodGet, keys: []string{"k"}, status: 201, want: createdHeader, resp: "run 2: GET 0 "},
				{method: http.MethodPut, keys: []string{"k", "k"}, body: "x", status: 201, want: createdHeader, resp: "run 3: PUT 1 x"},
			},
			runs: 3,
		},
		{
			name: "configured methods are guarded",
			opts: MiddlewareOptions{Scope: SingleTenant, Methods: []string{http.MethodPut}},
			calls: []call{
				{method: http.MethodPut, keys: []string{"k"}, body: "x", status: 201, want: createdHeader, resp: "run 1: PUT 1 x"},
				{method: http.MethodPut, keys: []string{"k"}, body: "x", status: 201, want: replayHeader, resp: "run 1: PUT 1 x"},
				{method: http.MethodPost, body: "x", status: 201, want: createdHeader, resp: "run 2: POST 1 x"},
			},
			runs: 2,
		},
		{
			name: "first request runs, the retry is replayed",
			calls: []call{
				post("k", "a", 201, createdHeader, "run 1: POST 1 a"),
				post("k", "a", 201, replayHeader, "run 1: POST 1 a"),
				post("k", "a", 201, replayHeader, "run 1: POST 1 a"),
				post("other", "a", 201, createdHeader, "run 2: POST 1 a"),
			},
			runs: 2,
		},
		{
			name: "missing key",
			calls: []call{
				{body: "a", status: 400, want: problemHeader, resp: bodyMissingKey},
				post("k", "b", 201, createdHeader, "run 1: POST 1 b"),
			},
			runs: 1,
		},
		{
			name: "optional key",
			opts: MiddlewareOptions{Scope: SingleTenant, OptionalKey: true},
			calls: []call{
				{body: "a", status: 201, want: createdHeader, resp: "run 1: POST 1 a"},
				{body: "a", status: 201, want: createdHeader, resp: "run 2: POST 1 a"},
				post("k", "a", 201, createdHeader, "run 3: POST 1 a"),
				post("k", "a", 201, replayHeader, "run 3: POST 1 a"),
			},
			runs: 3,
		},
		{
			name: "invalid keys",
			calls: []call{
				post("", "a", 400, problemHeader, bodyInvalidKey),
				post(`""`, "a", 400, problemHeader, bodyInvalidKey),
				post(longKey+"k", "a", 400, problemHeader, bodyInvalidKey),
				post("a b", "a", 400, problemHeader, bodyInvalidKey),
				post("caf\xc3\xa9", "a", 400, problemHeader, bodyInvalidKey),
				post(longKey, "a", 201, createdHeader, "run 1: POST 1 a"),
			},
			runs: 1,
		},
		{
			name: "key sent twice",
			calls: []call{
				{keys: []string{"k", "k"}, body: "a", status: 400, want: problemHeader, resp: bodyKeyRepeated},
				{keys: []string{"k", "other"}, body: "a", status: 400, want: problemHeader, resp: bodyKeyRepeated},
			},
		},
		{
			name: "sf-string and bare key are the same key",
			calls: []call{
				post(`"abc"`, "a", 201, createdHeader, "run 1: POST 1 a"),
				post(`abc`, "a", 201, replayHeader, "run 1: POST 1 a"),
				post(` "abc" `, "a", 201, replayHeader, "run 1: POST 1 a"),
				post(`a"b\c`, "a", 201, createdHeader, "run 2: POST 1 a"),
				post(`"a\"b\\c"`, "a", 201, replayHeader, "run 2: POST 1 a"),
			},
			runs: 2,
		},
		{
			name: "malformed sf-strings",
			calls: []call{
				post(`"abc`, "a", 400, problemHeader, bodyInvalidKey),
				post(`"abc"x`, "a", 400, problemHeader, bodyInvalidKey),
				post(`"abc";p=1`, "a", 400, problemHeader, bodyInvalidKey),
				post(`"abc", "def"`, "a", 400, problemHeader, bodyInvalidKey),
				post(`"a\b"`, "a", 400, problemHeader, bodyInvalidKey),
				post(`"ab\"`, "a", 400, problemHeader, bodyInvalidKey),
				post("\"a\tb\"", "a", 400, problemHeader, bodyInvalidKey),
			},
		},
		{
			name: "request body over the limit by Content-Length",
			opts: MiddlewareOptions{Scope: SingleTenant, MaxRequestBytes: 8},
			calls: []call{
				post("k", "123456789", 413, problemHeader, bodyTooLarge8),
				// Nothing was stored: the key takes a different request.
				post("k", "12345678", 201, createdHeader, "run 1: POST 8 12345678"),
				post("k", "12345678", 201, replayHeader, "run 1: POST 8 12345678"),
			},
			runs: 1,
		},
		{
			name: "request body over the limit, length unknown",
			opts: MiddlewareOptions{Scope: SingleTenant, MaxRequestBytes: 8},
			calls: []call{
				{keys: []string{"k"}, body: "123456789", chunked: true, status: 413, want: problemHeader, resp: bodyTooLarge8},
				{keys: []string{"k"}, body: "12345678", chunked: true, status: 201, want: createdHeader, resp: "run 1: POST 8 12345678"},
				post("k", "12345678", 201, replayHeader, "run 1: POST 8 12345678"),
			},
			runs: 1,
		},
		{
			name: "different request with the same key",
			calls: []call{
				post("k", "a", 201, createdHeader, "run 1: POST 1 a"),
				post("k", "b", 422, problemHeader, bodyMismatch),
				{method: http.MethodPatch, keys: []string{"k"}, body: "a", status: 422, want: problemHeader, resp: bodyMismatch},
				post("k", "a", 201, replayHeader, "run 1: POST 1 a"),
			},
			runs: 1,
		},
		{
			name: "equal JSON is the same request",
			calls: []call{
				{keys: []string{"k"}, body: `{"amount":100,"currency":"EUR"}`, header: map[string]string{"Content-Type": "application/json"},
					status: 201, want: createdHeader, resp: `run 1: POST 31 {"amount":100,"currency":"EUR"}`},
				{keys: []string{"k"}, body: `{ "currency": "EUR", "amount": 1e2 }`, header: map[string]string{"Content-Type": "application/json"},
					status: 201, want: replayHeader, resp: `run 1: POST 31 {"amount":100,"currency":"EUR"}`},
				{keys: []string{"k"}, body: `{"amount":101,"currency":"EUR"}`, header: map[string]string{"Content-Type": "application/json"},
					status: 422, want: problemHeader, resp: bodyMismatch},
			},
			runs: 1,
		},
		{
			name: "fingerprint headers",
			opts: MiddlewareOptions{Scope: SingleTenant, FingerprintHeaders: []string{"x-amount"}},
			calls: []call{
				{keys: []string{"k"}, body: "a", header: map[string]string{"X-Amount": "100", "X-Trace": "1"}, status: 201, want: createdHeader, resp: "run 1: POST 1 a"},
				{keys: []string{"k"}, body: "a", header: map[string]string{"X-Amount": "100", "X-Trace": "2"}, status: 201, want: replayHeader, resp: "run 1: POST 1 a"},
				{keys: []string{"k"}, body: "a", header: map[string]string{"X-Amount": "101", "X-Trace": "1"}, status: 422, want: problemHeader, resp: bodyMismatch},
			},
			runs: 1,
		},
		{
			name: "scopes separate tenants",
			opts: MiddlewareOptions{Scope: func(r *http.Request) (string, error) {
				if a := r.Header.Get("X-Account"); a != "" {
					return a, nil
				}
				return "", errInjected
			}},
			calls: []call{
				{keys: []string{"k"}, body: "a", header: map[string]string{"X-Account": "acct_1"}, status: 201, want: createdHeader, resp: "run 1: POST 1 a"},
				{keys: []string{"k"}, body: "b", header: map[string]string{"X-Account": "acct_2"}, status: 201, want: createdHeader, resp: "run 2: POST 1 b"},
				{keys: []string{"k"}, body: "a", header: map[string]string{"X-Account": "acct_1"}, status: 201, want: replayHeader, resp: "run 1: POST 1 a"},
				{keys: []string{"k"}, body: "b", header: map[string]string{"X-Account": "acct_2"}, status: 201, want: replayHeader, resp: "run 2: POST 1 b"},
				{keys: []string{"k"}, body: "a", status: 400, want: problemHeader, resp: bodyScope},
			},
			runs: 2,
		},
		{
			name:    "400 is forgotten: the key takes a corrected request",
			handler: func(w http.ResponseWriter, r *http.Request, run int64) { statusHandler(400+22*int(run-1))(w, r, run) },
			calls: []call{
				post("k", "a", 400, createdHeader, "status 400 run 1"),
				post("k", "b", 422, createdHeader, "status 422 run 2"),
				post("k", "c", 444, createdHeader, "status 444 run 3"),
				post("k", "c", 444, replayHeader, "status 444 run 3"),
				post("k", "a", 422, problemHeader, bodyMismatch),
			},
			runs: 3,
		},
		{
			name:    "5xx is released: the retry runs again",
			handler: func(w http.ResponseWriter, r *http.Request, run int64) { statusHandler(500+int(run))(w, r, run) },
			calls: []call{
				post("k", "a", 501, createdHeader, "status 501 run 1"),
				post("k", "b", 422, problemHeader, bodyMismatch),
				post("k", "a", 502, createdHeader, "status 502 run 2"),
			},
			runs: 2,
		},
		{
			name:    "3xx is kept",
			handler: statusHandler(http.StatusSeeOther),
			calls: []call{
				post("k", "a", 303, createdHeader, "status 303 run 1"),
				post("k", "a", 303, replayHeader, "status 303 run 1"),
			},
			runs: 1,
		},
		{
			name: "the Disposition option",
			opts: MiddlewareOptions{Scope: SingleTenant, Disposition: func(status int) Disposition {
				if status == http.StatusServiceUnavailable {
					return Keep
				}
				return DefaultDisposition(status)
			}},
			handler: statusHandler(http.StatusServiceUnavailable),
			calls: []call{
				post("k", "a", 503, createdHeader, "status 503 run 1"),
				post("k", "a", 503, replayHeader, "status 503 run 1"),
			},
			runs: 1,
		},
		{
			name: "the handler's SetDisposition wins",
			handler: func(w http.ResponseWriter, r *http.Request, run int64) {
				d := map[int64]Disposition{1: Forget, 2: Release, 3: Keep}[run]
				if !SetDisposition(r.Context(), d) {
					panic("no operation in the request context")
				}
				statusHandler(http.StatusCreated)(w, r, run)
			},
			calls: []call{
				post("k", "a", 201, createdHeader, "status 201 run 1"),
				post("k", "b", 201, createdHeader, "status 201 run 2"), // forgotten: any request
				post("k", "a", 422, problemHeader, bodyMismatch),
				post("k", "b", 201, createdHeader, "status 201 run 3"), // released: the same request
				post("k", "b", 201, replayHeader, "status 201 run 3"),
			},
			runs: 3,
		},
		{
			name: "replayed header fields",
			handler: func(w http.ResponseWriter, _ *http.Request, _ int64) {
				h := w.Header()
				h.Set("Content-Type", "application/json")
				h.Add("X-Multi", "one")
				h.Add("X-Multi", "two")
				h.Add("X-Multi", "three")
				h.Add("Set-Cookie", "session=abc")
				h.Add("Set-Cookie", "theme=dark")
				h.Set("Date", "Mon, 02 Jan 2006 15:04:05 GMT")
				h.Set("Connection", "X-Hop-A, x-hop-b")
				h.Set("X-Hop-A", "1")
				h.Set("X-Hop-B", "2")
				h.Set("Keep-Alive", "timeout=5")
				h.Set("Proxy-Authenticate", "Basic")
				h.Set("Proxy-Authorization", "Basic eA==")
				h.Set("TE", "trailers")
				h.Set("Trailer", "X-Sum")
				h.Set("Transfer-Encoding", "chunked")
				h.Set("Upgrade", "h2c")
				h.Set(HeaderReplayed, "false")
				h.Set("Location", "/charges/1")
				w.WriteHeader(http.StatusCreated)
				h.Set("X-Late", "not sent: the header was already written")
				_, _ = w.Write([]byte(`{"id":1}`))
			},
			calls: []call{
				post("k", "a", 201, hdr("Content-Type", "application/json", "X-Multi", "one", "X-Multi", "two", "X-Multi", "three",
					"Set-Cookie", "session=abc", "Set-Cookie", "theme=dark", "Date", "Mon, 02 Jan 2006 15:04:05 GMT",
					"Connection", "X-Hop-A, x-hop-b", "X-Hop-A", "1", "X-Hop-B", "2", "Keep-Alive", "timeout=5",
					"Proxy-Authenticate", "Basic", "Proxy-Authorization", "Basic eA==", "TE", "trailers", "Trailer", "X-Sum",
					"Transfer-Encoding", "chunked", "Upgrade", "h2c", HeaderReplayed, "false", "Location", "/charges/1"), `{"id":1}`),
				post("k", "a", 201, hdr("Content-Type", "application/json", "X-Multi", "one", "X-Multi", "two", "X-Multi", "three",
					"Location", "/charges/1", HeaderReplayed, "true"), `{"id":1}`),
			},
			runs: 1,
		},
		{
			name: "stored fields replace those of outer middleware",
			handler: func(w http.ResponseWriter, _ *http.Request, _ int64) {
				w.Header().Set("X-Outer", "handler")
				w.WriteHeader(http.StatusAccepted)
			},
			calls: []call{
				{keys: []string{"k"}, header: map[string]string{"X-Set-Outer": "outer"}, status: 202, want: hdr("X-Outer", "handler", "X-Only-Outer", "outer")},
				{keys: []string{"k"}, header: map[string]string{"X-Set-Outer": "outer"}, status: 202, want: hdr("X-Outer", "handler", "X-Only-Outer", "outer", HeaderReplayed, "true")},
			},
			runs: 1,
		},
		{
			name:    "a handler that writes nothing answers 200",
			handler: func(http.ResponseWriter, *http.Request, int64) {},
			calls: []call{
				post("k", "a", 200, hdr(), ""),
				post("k", "a", 200, hdr(HeaderReplayed, "true"), ""),
			},
			runs: 1,
		},
		{
			name: "an unset Content-Type is sniffed once and stored",
			handler: func(w http.ResponseWriter, _ *http.Request, _ int64) {
				_, _ = io.WriteString(w, "<html><body>charged</body></html>")
			},
			calls: []call{
				post("k", "a", 200, hdr("Content-Type", "text/html; charset=utf-8"), "<html><body>charged</body></html>"),
				post("k", "a", 200, hdr("Content-Type", "text/html; charset=utf-8", HeaderReplayed, "true"), "<html><body>charged</body></html>"),
			},
			runs: 1,
		},
		{
			name: "informational responses and a body on 204 are dropped",
			handler: func(w http.ResponseWriter, _ *http.Request, _ int64) {
				w.Header().Set("Link", "</style.css>; rel=preload")
				w.WriteHeader(http.StatusEarlyHints)
				w.WriteHeader(http.StatusNoContent)
				w.WriteHeader(http.StatusOK) // superfluous
				if _, err := w.Write([]byte("x")); !errors.Is(err, http.ErrBodyNotAllowed) {
					panic(err)
				}
			},
			calls: []call{
				post("k", "a", 204, hdr("Link", "</style.css>; rel=preload"), ""),
				post("k", "a", 204, hdr("Link", "</style.css>; rel=preload", HeaderReplayed, "true"), ""),
			},
			runs: 1,
		},
		{
			name:  "store unavailable: 503, the handler does not run",
			fault: failOn(storeerr.Unavailable("claim", errInjected), "claim"),
			calls: []call{
				post("k", "a", 503, retryHeader, bodyUnavailable),
				{body: "a", status: 400, want: problemHeader, resp: bodyMissingKey},
			},
		},
		{
			name:  "Retry-After is whole seconds, rounded up",
			opts:  MiddlewareOptions{Scope: SingleTenant, RetryAfter: 1500 * time.Millisecond},
			fault: failOn(storeerr.Unavailable("claim", errInjected), "claim"),
			calls: []call{
				post("k", "a", 503, hdr("Content-Type", "application/problem+json", "Cache-Control", "no-store", "Retry-After", "2"), bodyUnavailable),
			},
		},
		{
			name:  "store unavailable with FailOpen: the handler runs unguarded",
			opts:  MiddlewareOptions{Scope: SingleTenant, FailOpen: true},
			fault: failOn(storeerr.Unavailable("claim", errInjected), "claim"),
			calls: []call{
				post("k", "a", 201, createdHeader, "run 1: POST 1 a"),
				post("k", "a", 201, createdHeader, "run 2: POST 1 a"),
			},
			runs: 2,
		},
		{
			name:  "FailOpen never runs a request known to be in flight",
			opts:  MiddlewareOptions{Scope: SingleTenant, FailOpen: true},
			fault: failOn(errors.Join(ErrInFlight, storeerr.Unavailable("claim", errInjected)), "claim"),
			calls: []call{
				post("k", "a", 409, retryHeader, bodyInFlight),
			},
		},
		{
			name:  "storing the outcome fails: 503, the response is not sent, even with FailOpen",
			opts:  MiddlewareOptions{Scope: SingleTenant, FailOpen: true},
			fault: failOn(storeerr.Unavailable("complete", errInjected), "complete"),
			calls: []call{
				post("k", "a", 503, retryHeader, bodyUnavailable),
			},
			runs: 1,
		},
		{
			name:  "fenced at completion: 503, the response is not sent",
			fault: failOn(ErrFenced, "complete"),
			calls: []call{
				post("k", "a", 503, retryHeader, bodyFenced),
			},
			runs: 1,
		},
		{
			name:    "fenced at release: 503, the response is not sent",
			fault:   failOn(ErrFenced, "release"),
			handler: statusHandler(http.StatusInternalServerError),
			calls: []call{
				post("k", "a", 503, retryHeader, bodyFenced),
			},
			runs: 1,
		},
	}
	for _, row := range rows {
		t.Run(row.name, func(t *testing.T) {
			var s Store = newStore(t)
			if row.fault != nil {
				s = &faultStore{Store: s, hook: row.fault}
			}
			handle := row.handler
			if handle == nil {
				handle = echo
			}
			var runs atomic.Int64
			if row.opts.Scope == nil {
				row.opts.Scope = SingleTenant
			}
			h := New(s, Options{}).Middleware(row.opts)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				handle(w, r, runs.Add(1))
			}))
			outer := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if v := r.Header.Get("X-Set-Outer"); v != "" {
					w.Header().Set("X-Outer", v)
					w.Header().Set("X-Only-Outer", v)
				}
				h.ServeHTTP(w, r)
			})
			for i, c := range row.calls {
				rr := httptest.NewRecorder()
				outer.ServeHTTP(rr, c.request())
				res := rr.Result()
				body, err := io.ReadAll(res.Body)
				require.NoError(t, err)
				assert.Equal(t, c.status, res.StatusCode, "call %d", i)
				assert.Equal(t, c.want, res.Header, "call %d", i)
				assert.Equal(t, c.resp, string(body), "call %d", i)
			}
			assert.Equal(t, row.runs, runs.Load(), "handler runs")
		})
	}
}

func TestMiddlewareUnreadableBody(t *testing.T) {
	eachStore(t, func(t *testing.T, newStore func(*testing.T) Store) {
		var runs atomic.Int64
		h := New(newStore(t), Options{}).Middleware(MiddlewareOptions{Scope: SingleTenant})(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { runs.Add(1) }))
		for _, tc := range []struct {
			name   string
			body   func(w http.ResponseWriter) io.ReadCloser
			status int
			resp   string
		}{
			{"read error", func(http.ResponseWriter) io.ReadCloser {
				return io.NopCloser(io.MultiReader(strings.NewReader("abc"), iotestErrReader{}))
			}, 400, bodyUnreadable},
			{"outer MaxBytesReader", func(w http.ResponseWriter) io.ReadCloser {
				return http.MaxBytesReader(w, io.NopCloser(strings.NewReader("0123456789")), 4)
			}, 413, problemBody("body-too-large", "Request body too large", 413, "The request body exceeds 4 bytes.")},
		} {
			t.Run(tc.name, func(t *testing.T) {
				rr := httptest.NewRecorder()
				r := httptest.NewRequest(http.MethodPost, "/", tc.body(rr))
				r.Header.Set(HeaderKey, "k")
				h.ServeHTTP(rr, r)
				assert.Equal(t, tc.status, rr.Code)
				assert.Equal(t, problemHeader, rr.Header())
				assert.Equal(t, tc.resp, rr.Body.String())
			})
		}
		assert.Zero(t, runs.Load())
	})
}

type iotestErrReader struct{}

func (iotestErrReader) Read([]byte) (int, error) { return 0, errInjected }

// TestMiddlewareConcurrentDuplicates sends one key 100 times at once over
// HTTP: the handler runs once, and all 100 get its response.
func TestMiddlewareConcurrentDuplicates(t *testing.T) { eachStore(t, middlewareConcurrentDuplicates) }

func middlewareConcurrentDuplicates(t *testing.T, newStore func(*testing.T) Store) {
	const n = 100
	var waiting atomic.Int64
	allWaiting := make(chan struct{})
	s := &faultStore{Store: newStore(t), hook: func(_ context.Context, op string) error {
		if op == "subscribe" && waiting.Add(1) == n-1 {
			close(allWaiting)
		}
		return nil
	}}
	var runs atomic.Int64
	h := New(s, Options{}).Middleware(MiddlewareOptions{Scope: SingleTenant})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		run := runs.Add(1)
		// Hold the original until every duplicate waits for it, so
		// that all of them take the waiting path.
		select {
		case <-allWaiting:
		case <-time.After(10 * time.Second):
		}
		dk, err := DownstreamKey(r.Context(), "test")
		assert.NoError(t, err)
		w.Header().Set("X-Operation", dk)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "run %d", run)
	}))
	srv := httptest.NewServer(h)
	defer srv.Close()

	type answer struct {
		status   int
		body     string
		op       string
		replayed string
	}
	answers := make([]answer, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			req, err := http.NewRequest(http.MethodPost, srv.URL+"/charges", strings.NewReader(`{"amount":100}`))
			if !assert.NoError(t, err) {
				return
			}
			req.Header.Set(HeaderKey, "same-key")
			req.Header.Set("Content-Type", "application/json")
			res, err := srv.Client().Do(req)
			if !assert.NoError(t, err) {
				return
			}
			defer res.Body.Close()
			b, err := io.ReadAll(res.Body)
			assert.NoError(t, err)
			answers[i] = answer{res.StatusCode, string(b), res.Header.Get("X-Operation"), res.Header.Get(HeaderReplayed)}
		})
	}
	wg.Wait()
	assert.Equal(t, int64(1), runs.Load())
	replays := 0
	for _, a := range answers {
		assert.Equal(t, 201, a.status)
		assert.Equal(t, "run 1", a.body)
		assert.Equal(t, answers[0].op, a.op)
		assert.NotEmpty(t, a.op)
		if a.replayed == "true" {
			replays++
		}
	}
	assert.Equal(t, n-1, replays)
}

// blockingHandler runs until release is closed; entered receives once it
// runs.
func blockingHandler(entered chan<- struct{}, release <-chan struct{}) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		entered <- struct{}{}
		<-release
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "done")
	})
}

func serve(h http.Handler, r *http.Request) *httptest.ResponseRecorder {
	rr := httptest.NewRecorder()
	h.ServeHTTP(rr, r)
	return rr
}

func keyed(key, body string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/charges", strings.NewReader(body))
	r.Header.Set(HeaderKey, key)
	return r
}

// TestMiddlewareWaitsForOriginal: a duplicate of a running request waits
// for it and gets its response.
func TestMiddlewareWaitsForOriginal(t *testing.T) { eachStore(t, middlewareWaitsForOriginal) }

func middlewareWaitsForOriginal(t *testing.T, newStore func(*testing.T) Store) {
	subscribed := make(chan struct{}, 1)
	s := &faultStore{Store: newStore(t), hook: func(_ context.Context, op string) error {
		if op == "subscribe" {
			subscribed <- struct{}{}
		}
		return nil
	}}
	entered, release := make(chan struct{}, 2), make(chan struct{})
	h := New(s, Options{}).Middleware(MiddlewareOptions{Scope: SingleTenant})(blockingHandler(entered, release))

	original := make(chan *httptest.ResponseRecorder)
	go func() { original <- serve(h, keyed("k", "a")) }()
	<-entered
	duplicate := make(chan *httptest.ResponseRecorder)
	go func() { duplicate <- serve(h, keyed("k", "a")) }()
	<-subscribed
	close(release)

	o, d := <-original, <-duplicate
	assert.Equal(t, 201, o.Code)
	assert.Equal(t, createdHeader, o.Header())
	assert.Equal(t, "done", o.Body.String())
	assert.Equal(t, 201, d.Code)
	assert.Equal(t, replayHeader, d.Header())
	assert.Equal(t, "done", d.Body.String())
	assert.Empty(t, entered, "the duplicate ran the handler")
}

// TestMiddlewareWaitTimeout: a duplicate that waits longer than
// WaitTimeout gets 409 with Retry-After; the original is unaffected.
func TestMiddlewareWaitTimeout(t *testing.T) {
	eachStore(t, func(t *testing.T, newStore func(*testing.T) Store) {
		entered, release := make(chan struct{}, 2), make(chan struct{})
		h := New(newStore(t), Options{WaitTimeout: 20 * time.Millisecond}).Middleware(MiddlewareOptions{Scope: SingleTenant})(blockingHandler(entered, release))

		original := make(chan *httptest.ResponseRecorder)
		go func() { original <- serve(h, keyed("k", "a")) }()
		<-entered
		d := serve(h, keyed("k", "a"))
		close(release)
		assert.Equal(t, 409, d.Code)
		assert.Equal(t, retryHeader, d.Header())
		assert.Equal(t, bodyInFlight, d.Body.String())

		o := <-original
		assert.Equal(t, 201, o.Code)
		assert.Equal(t, "done", o.Body.String())
		assert.Empty(t, entered, "the duplicate ran the handler")
	})
}

// TestMiddlewareLeaseLost: when the lease is lost while the handler runs,
// its context is cancelled with ErrFenced and its response is not sent.
func TestMiddlewareLeaseLost(t *testing.T) {
	eachStore(t, func(t *testing.T, newStore func(*testing.T) Store) {
		s := &faultStore{Store: newStore(t), hook: failOn(ErrFenced, "heartbeat")}
		cause := make(chan error, 1)
		// A lease long enough that a slow claim on a loaded machine is
		// still confirmed in time: the first renewal, at Lease/3, is refused.
		h := New(s, Options{Lease: 300 * time.Millisecond}).Middleware(MiddlewareOptions{Scope: SingleTenant})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			select {
			case <-r.Context().Done():
				cause <- context.Cause(r.Context())
			case <-time.After(10 * time.Second):
				cause <- errors.New("the context was not cancelled")
			}
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, "charged anyway")
		}))
		rr := serve(h, keyed("k", "a"))
		require.Len(t, cause, 1, "the handler did not run: %d %s", rr.Code, rr.Body)
		assert.ErrorIs(t, <-cause, ErrFenced)
		assert.Equal(t, 503, rr.Code)
		assert.Equal(t, retryHeader, rr.Header())
		assert.Equal(t, bodyFenced, rr.Body.String())
	})
}

// journal records, in order, what reaches the client and the store.
type journal struct {
	mu     sync.Mutex
	events []string
}

func (j *journal) add(format string, args ...any) {
	j.mu.Lock()
	j.events = append(j.events, fmt.Sprintf(format, args...))
	j.mu.Unlock()
}

func (j *journal) list() []string {
	j.mu.Lock()
	defer j.mu.Unlock()
	return append([]string(nil), j.events...)
}

// journalWriter is a client's ResponseWriter that writes to the journal.
type journalWriter struct {
	*httptest.ResponseRecorder
	j *journal
}

func (w journalWriter) WriteHeader(code int) {
	w.j.add("client: status %d", code)
	w.ResponseRecorder.WriteHeader(code)
}

func (w journalWriter) Write(p []byte) (int, error) {
	w.j.add("client: %q", p)
	return w.ResponseRecorder.Write(p)
}

func (w journalWriter) Flush() {
	w.j.add("client: flush")
	w.ResponseRecorder.Flush()
}

func journaled(t *testing.T, s Store, j *journal, fail func(ctx context.Context, op string) error) Store {
	return &faultStore{Store: s, hook: func(ctx context.Context, op string) error {
		if op == "heartbeat" {
			return nil
		}
		err := fail(ctx, op)
		j.add("store: %s %v", op, err)
		return err
	}}
}

// TestMiddlewarePersistThenSend: nothing reaches the client, not even on
// Flush, before the outcome is stored; Hijack fails.
func TestMiddlewarePersistThenSend(t *testing.T) {
	eachStore(t, func(t *testing.T, newStore func(*testing.T) Store) {
		j := &journal{}
		var hijackErr error
		h := New(journaled(t, newStore(t), j, failOn(nil)), Options{}).Middleware(MiddlewareOptions{Scope: SingleTenant})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, "one ")
			w.(http.Flusher).Flush()
			assert.NoError(t, http.NewResponseController(w).Flush())
			_, _ = io.WriteString(w, "two")
			_, _, hijackErr = http.NewResponseController(w).Hijack()
			j.add("handler: returns")
		}))
		rr := httptest.NewRecorder()
		h.ServeHTTP(journalWriter{rr, j}, keyed("k", "a"))
		assert.ErrorIs(t, hijackErr, errHijack)
		assert.Equal(t, []string{
			"store: claim <nil>",
			"handler: returns",
			"store: complete <nil>",
			"client: status 201",
			`client: "one two"`,
		}, j.list())
		assert.Equal(t, 201, rr.Code)
		assert.Equal(t, "one two", rr.Body.String())
	})
}

// TestMiddlewareTooLargeResponse: a response over MaxResponseBytes is
// settled without its body before its first byte is sent, then streamed
// whole to the first client; a retry gets it bodiless and marked.
func TestMiddlewareTooLargeResponse(t *testing.T) {
	eachStore(t, func(t *testing.T, newStore func(*testing.T) Store) {
		j := &journal{}
		var runs atomic.Int64
		var writeErr error
		h := New(journaled(t, newStore(t), j, failOn(nil)), Options{}).Middleware(MiddlewareOptions{Scope: SingleTenant, MaxResponseBytes: 16})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.Header().Set("Content-Length", "30")
			w.Header().Add("X-Multi", "a")
			w.Header().Add("X-Multi", "b")
			w.Header().Set("Set-Cookie", "session=abc")
			_, _ = io.WriteString(w, "0123456789")
			w.(http.Flusher).Flush()
			j.add("handler: 10 bytes written")
			_, _ = io.WriteString(w, "abcdefghij")
			j.add("handler: 20 bytes written")
			_, writeErr = io.WriteString(w, "KLMNOPQRST")
			w.(http.Flusher).Flush()
			// Do has returned; the handler's context must not end with it.
			select {
			case <-r.Context().Done():
				t.Errorf("the handler's context ended with Do: %v", context.Cause(r.Context()))
			case <-time.After(50 * time.Millisecond):
			}
		}))
		rr := httptest.NewRecorder()
		h.ServeHTTP(journalWriter{rr, j}, keyed("k", "a"))
		require.NoError(t, writeErr)
		assert.Equal(t, []string{
			"store: claim <nil>",
			"handler: 10 bytes written",
			"store: complete <nil>",
			"client: status 200",
			`client: "0123456789"`,
			`client: "abcdefghij"`,
			"handler: 20 bytes written",
			`client: "KLMNOPQRST"`,
			"client: flush",
		}, j.list())
		assert.Equal(t, 200, rr.Code)
		assert.Equal(t, hdr("Content-Length", "30", "Content-Type", "text/plain; charset=utf-8", "X-Multi", "a", "X-Multi", "b", "Set-Cookie", "session=abc"), rr.Header())
		assert.Equal(t, "0123456789abcdefghijKLMNOPQRST", rr.Body.String())

		rr = serve(h, keyed("k", "a"))
		assert.Equal(t, 200, rr.Code)
		assert.Equal(t, hdr("Content-Type", "text/plain; charset=utf-8", "X-Multi", "a", "X-Multi", "b",
			HeaderBodyOmitted, "too-large", HeaderReplayed, "true"), rr.Header())
		assert.Empty(t, rr.Body.String())
		assert.Equal(t, int64(1), runs.Load())
	})
}

// TestMiddlewareTooLargeResponseNotStored: when settling a too-large
// response fails, the client gets 503 and none of the handler's bytes.
func TestMiddlewareTooLargeResponseNotStored(t *testing.T) {
	for _, fault := range []error{ErrFenced, storeerr.Unavailable("complete", errInjected)} {
		t.Run(fault.Error(), func(t *testing.T) {
			eachStore(t, func(t *testing.T, newStore func(*testing.T) Store) {
				var writeErrs []error
				h := New(&faultStore{Store: newStore(t), hook: failOn(fault, "complete")}, Options{}).
					Middleware(MiddlewareOptions{Scope: SingleTenant, MaxResponseBytes: 4})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					for range 3 {
						_, err := io.WriteString(w, "abc")
						writeErrs = append(writeErrs, err)
					}
				}))
				rr := serve(h, keyed("k", "a"))
				assert.Equal(t, []error{nil, errNotStored, errNotStored}, writeErrs)
				assert.Equal(t, 503, rr.Code)
				assert.Equal(t, retryHeader, rr.Header())
				want := bodyUnavailable
				if errors.Is(fault, ErrFenced) {
					want = bodyFenced
				}
				assert.Equal(t, want, rr.Body.String())
			})
		})
	}
}

// TestMiddlewarePanicReleasesKey: a panic goes on unchanged to net/http
// after the key was released, so the next request runs the handler.
func TestMiddlewarePanicReleasesKey(t *testing.T) {
	for _, value := range []any{"boom", http.ErrAbortHandler} {
		t.Run(fmt.Sprint(value), func(t *testing.T) {
			eachStore(t, func(t *testing.T, newStore func(*testing.T) Store) {
				var runs atomic.Int64
				h := New(newStore(t), Options{}).Middleware(MiddlewareOptions{Scope: SingleTenant})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					if runs.Add(1) == 1 {
						_, _ = io.WriteString(w, "partial")
						panic(value)
					}
					info, _ := FromContext(r.Context())
					fmt.Fprintf(w, "attempt %d takeover %t", info.Attempt, info.Takeover)
				}))
				rr := httptest.NewRecorder()
				assert.PanicsWithValue(t, value, func() { h.ServeHTTP(rr, keyed("k", "a")) })
				assert.False(t, rr.Flushed)
				assert.Empty(t, rr.Body.String(), "bytes of the panicked attempt were sent")

				rr = serve(h, keyed("k", "a"))
				assert.Equal(t, 200, rr.Code)
				assert.Equal(t, "attempt 2 takeover true", rr.Body.String())
				assert.Equal(t, int64(2), runs.Load())
			})
		})
	}
}

// TestMiddlewareInfoInHandler: the handler's context carries the attempt's
// Info; a retry after a release keeps the operation ID and so the
// downstream key.
func TestMiddlewareInfoInHandler(t *testing.T) {
	eachStore(t, func(t *testing.T, newStore func(*testing.T) Store) {
		type seen struct {
			operationID, downstream string
			attempt                 int
			token                   uint64
			takeover                bool
		}
		var attempts []seen
		h := New(newStore(t), Options{}).Middleware(MiddlewareOptions{Scope: SingleTenant})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			info, ok := FromContext(r.Context())
			require.True(t, ok)
			dk, err := DownstreamKey(r.Context(), "gateway")
			require.NoError(t, err)
			attempts = append(attempts, seen{info.OperationID, dk, info.Attempt, info.Token, info.Takeover})
			w.WriteHeader([]int{http.StatusBadGateway, http.StatusAccepted}[len(attempts)-1])
		}))
		assert.Equal(t, 502, serve(h, keyed("k", "a")).Code)
		assert.Equal(t, 202, serve(h, keyed("k", "a")).Code)
		rr := serve(h, keyed("k", "a"))
		assert.Equal(t, 202, rr.Code)
		assert.Equal(t, "true", rr.Header().Get(HeaderReplayed))

		require.Len(t, attempts, 2)
		first, second := attempts[0], attempts[1]
		assert.NotEmpty(t, first.operationID)
		assert.Equal(t, first.operationID, second.operationID)
		assert.Equal(t, first.downstream, second.downstream)
		assert.True(t, strings.HasPrefix(first.downstream, "idem_"), first.downstream)
		assert.Equal(t, []int{1, 2}, []int{first.attempt, second.attempt})
		assert.Equal(t, []bool{false, true}, []bool{first.takeover, second.takeover})
		assert.Greater(t, second.token, first.token)
	})
}

// TestMiddlewareOverHTTP runs the middleware behind a real server: cookies
// and trailers reach the first client only, Date is the server's own, and
// an aborted handler leaves the key free.
func TestMiddlewareOverHTTP(t *testing.T) {
	eachStore(t, func(t *testing.T, newStore func(*testing.T) Store) {
		var runs atomic.Int64
		h := New(newStore(t), Options{}).Middleware(MiddlewareOptions{Scope: SingleTenant})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			run := runs.Add(1)
			if r.Header.Get("X-Abort") == "yes" && run == 1 {
				panic(http.ErrAbortHandler)
			}
			b, _ := io.ReadAll(r.Body)
			// Deadlines are the connection's: they reach it through Unwrap.
			assert.NoError(t, http.NewResponseController(w).SetWriteDeadline(time.Now().Add(time.Minute)))
			w.Header().Set("Set-Cookie", "session=abc")
			w.Header().Set("Trailer", "X-Checksum")
			w.Header().Set("Content-Type", "text/plain")
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, "run %d: %s", run, b)
			w.Header().Set("X-Checksum", "c0ffee")
		}))
		srv := httptest.NewServer(h)
		defer srv.Close()
		send := func(key, body string, header ...string) (*http.Response, string, error) {
			req, err := http.NewRequest(http.MethodPost, srv.URL, io.MultiReader(strings.NewReader(body))) // chunked
			require.NoError(t, err)
			req.Header.Set(HeaderKey, strconv.Quote(key))
			for i := 0; i < len(header); i += 2 {
				req.Header.Set(header[i], header[i+1])
			}
			res, err := srv.Client().Do(req)
			if err != nil {
				return nil, "", err
			}
			defer res.Body.Close()
			b, err := io.ReadAll(res.Body)
			require.NoError(t, err)
			return res, string(b), nil
		}

		res, body, err := send("k1", "a")
		require.NoError(t, err)
		assert.Equal(t, 201, res.StatusCode)
		assert.Equal(t, "run 1: a", body)
		assert.Equal(t, "session=abc", res.Header.Get("Set-Cookie"))
		assert.Equal(t, "c0ffee", res.Trailer.Get("X-Checksum"))
		assert.NotEmpty(t, res.Header.Get("Date"))
		assert.Empty(t, res.Header.Get(HeaderReplayed))

		res, body, err = send("k1", "a")
		require.NoError(t, err)
		assert.Equal(t, 201, res.StatusCode)
		assert.Equal(t, "run 1: a", body)
		assert.Empty(t, res.Header.Values("Set-Cookie"))
		assert.Empty(t, res.Trailer)
		assert.NotEmpty(t, res.Header.Get("Date"))
		assert.Equal(t, "true", res.Header.Get(HeaderReplayed))

		runs.Store(0)
		_, _, err = send("k2", "b", "X-Abort", "yes")
		require.Error(t, err, "an aborted handler must abort the response")
		res, body, err = send("k2", "b", "X-Abort", "yes")
		require.NoError(t, err)
		assert.Equal(t, 201, res.StatusCode)
		assert.Equal(t, "run 2: b", body)
	})
}

func TestParseKey(t *testing.T) {
	for in, want := range map[string]string{
		`abc`:        "abc",
		`"abc"`:      "abc",
		` "abc"	`:    "abc",
		`"a\"b\\c"`:  `a"b\c`,
		`a"b`:        `a"b`,
		`"a b"`:      "a b", // a valid sf-string, refused later by Key.Validate
		`""`:         "",
		`"\\\\\""`:   `\\"`,
		`"~!#$%&'("`: `~!#$%&'(`,
	} {
		got, err := parseKey(in)
		assert.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	for _, in := range []string{`"`, `"abc`, `"abc"x`, `"abc" "`, `"a\b"`, `"a\`, "\"a\x7f\"", "\"a\x00\"", `"abc";a=1`} {
		_, err := parseKey(in)
		assert.ErrorIs(t, err, ErrInvalidKey, in)
	}
}

// FuzzParseKey: any field value parses or fails with ErrInvalidKey, never
// panics; a bare key comes back trimmed and unchanged, and a key parsed from
// an sf-string, written as one again, parses back to itself.
func FuzzParseKey(f *testing.F) {
	for _, seed := range []string{`abc`, `"abc"`, ` "a\"b\\c"	`, `"`, `"abc"x`, "\"a\x00\"", `"abc";a=1`, ``} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, v string) {
		key, err := parseKey(v)
		if err != nil {
			if !errors.Is(err, ErrInvalidKey) {
				t.Fatalf("parseKey(%q): %v, want ErrInvalidKey", v, err)
			}
			return
		}
		trimmed := strings.Trim(v, " \t")
		if !strings.HasPrefix(trimmed, `"`) {
			if key != trimmed {
				t.Fatalf("parseKey(%q) = %q, want the bare key %q", v, key, trimmed)
			}
			return
		}
		quoted := `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(key) + `"`
		if again, err := parseKey(quoted); err != nil || again != key {
			t.Fatalf("parseKey(%q) = %q, written as %s it parses to %q, %v", v, key, quoted, again, err)
		}
	})
}

func TestDefaultDisposition(t *testing.T) {
	for status, want := range map[int]Disposition{
		200: Keep, 201: Keep, 204: Keep, 302: Keep, 402: Keep, 404: Keep, 410: Keep,
		400: Forget, 401: Forget, 403: Forget, 408: Forget, 409: Forget, 422: Forget, 429: Forget,
		500: Release, 502: Release, 503: Release, 599: Release,
	} {
		assert.Equal(t, want, DefaultDisposition(status), "status %d", status)
	}
}

// TestMiddlewareFailOpenNotForGoneClient: a store failure while the client
// is gone may be the cancellation's doing, so FailOpen does not run the
// handler, and the answer says the client went away, not that the store
// failed.
func TestMiddlewareFailOpenNotForGoneClient(t *testing.T) {
	eachStore(t, func(t *testing.T, newStore func(*testing.T) Store) {
		ctx, cancel := context.WithCancel(context.Background())
		s := &faultStore{Store: newStore(t), hook: func(context.Context, string) error {
			cancel()
			return storeerr.Unavailable("claim", ctx.Err())
		}}
		var runs atomic.Int64
		h := New(s, Options{}).Middleware(MiddlewareOptions{Scope: SingleTenant, FailOpen: true})(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { runs.Add(1) }))
		rr := serve(h, keyed("k", "a").WithContext(ctx))
		assert.Equal(t, 499, rr.Code)
		assert.Contains(t, rr.Body.String(), "#client-gone")
		assert.Zero(t, runs.Load())
	})
}

// TestMiddlewareInvalidStatus: an invalid status panics as net/http does,
// and the key is released.
func TestMiddlewareInvalidStatus(t *testing.T) {
	eachStore(t, func(t *testing.T, newStore func(*testing.T) Store) {
		var runs atomic.Int64
		h := New(newStore(t), Options{}).Middleware(MiddlewareOptions{Scope: SingleTenant})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if runs.Add(1) == 1 {
				w.WriteHeader(42)
			}
			w.WriteHeader(http.StatusAccepted)
		}))
		// A request made by hand may have no body at all.
		r, err := http.NewRequest(http.MethodPost, "/charges", nil)
		require.NoError(t, err)
		r.Header.Set(HeaderKey, "k")
		assert.PanicsWithValue(t, "invalid WriteHeader code 42", func() { serve(h, r) })
		assert.Equal(t, 202, serve(h, r).Code)
		assert.Equal(t, 202, serve(h, r).Code)
		assert.Equal(t, int64(2), runs.Load())
	})
}

// TestMiddlewareErrors: MiddlewareOptions.Errors writes every error answer
// (here, in an API's own format, with a status of its own) from the request
// and the problem, while Retry-After and Cache-Control stay the
// middleware's.
func TestMiddlewareErrors(t *testing.T) {
	var seen []Problem
	own := func(w http.ResponseWriter, r *http.Request, p Problem) {
		seen = append(seen, p)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(p.Status + 1)
		_ = json.NewEncoder(w).Encode(map[string]string{"code": p.Code, "path": r.URL.Path, "message": p.Detail})
	}
	entered, release := make(chan struct{}, 1), make(chan struct{})
	h := New(NewMemoryStore(MemoryOptions{}), Options{WaitTimeout: -1}).Middleware(MiddlewareOptions{
		Scope: SingleTenant, Errors: own, RetryAfter: 3 * time.Second, MaxRequestBytes: 8,
	})(blockingHandler(entered, release))
	done := make(chan struct{})
	go func() { serve(h, keyed("k", "a")); close(done) }()
	<-entered
	defer func() { close(release); <-done }()

	cases := []struct {
		name   string
		req    *http.Request
		status int
		code   string
		retry  string
	}{
		{"InFlight", keyed("k", "a"), http.StatusConflict, "in-flight", "3"},
		{"MissingKey", httptest.NewRequest(http.MethodPost, "/charges", nil), http.StatusBadRequest, "missing-key", ""},
		{"InvalidKey", keyed("a b", "a"), http.StatusBadRequest, "invalid-key", ""},
		{"TooLarge", keyed("big", "123456789"), http.StatusRequestEntityTooLarge, "body-too-large", ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rr := serve(h, c.req)
			assert.Equal(t, c.status+1, rr.Code, "the format's own status")
			assert.Equal(t, c.retry, rr.Header().Get("Retry-After"))
			assert.Equal(t, "no-store", rr.Header().Get("Cache-Control"))
			p := seen[len(seen)-1]
			assert.Equal(t, ProblemTypes+c.code, p.Type)
			assert.Equal(t, c.code, p.Code)
			assert.Equal(t, c.status, p.Status)
			var body map[string]string
			require.NoError(t, json.Unmarshal(rr.Body.Bytes(), &body), rr.Body.String())
			assert.Equal(t, map[string]string{"code": c.code, "path": "/charges", "message": p.Detail}, body)
		})
	}
}

// TestStripeErrors: the Stripe profile answers every problem with Stripe's
// error body, the class its SDKs map each problem to, 400 for a reused key,
// and Stripe-Should-Retry where a retry under the key can succeed.
func TestStripeErrors(t *testing.T) {
	cases := []struct {
		err    error
		status int
		kind   string
		retry  string
	}{
		{errKeyMissing, 400, "idempotency_error", "false"},
		{errKeyRepeated, 400, "idempotency_error", "false"},
		{ErrInvalidKey, 400, "idempotency_error", "false"},
		{errScope, 400, "invalid_request_error", "false"},
		{errBodyUnreadable, 400, "invalid_request_error", "false"},
		{bodyTooLargeError{8}, 400, "invalid_request_error", "false"},
		{ErrMismatch, 400, "idempotency_error", "false"},
		{ErrInFlight, 409, "idempotency_error", "true"},
		{ErrFenced, 503, "api_error", "true"},
		{ErrUnavailable, 503, "api_error", "true"},
		{errClientGone, 499, "api_error", "false"},
	}
	for _, c := range cases {
		p := problemFor(c.err)
		t.Run(p.Code, func(t *testing.T) {
			rr := httptest.NewRecorder()
			StripeErrors(rr, httptest.NewRequest(http.MethodPost, "/v1/charges", nil), p)
			assert.Equal(t, c.status, rr.Code)
			assert.Equal(t, "application/json", rr.Header().Get("Content-Type"))
			assert.Equal(t, c.retry, rr.Header().Get("Stripe-Should-Retry"))
			var body struct{ Error map[string]string }
			require.NoError(t, json.Unmarshal(rr.Body.Bytes(), &body), rr.Body.String())
			assert.Equal(t, map[string]string{"type": c.kind, "code": p.Code, "message": p.Detail, "doc_url": p.Type}, body.Error)
		})
	}
}

// TestProblemTypesResolve: every problem's type URI names a heading of
// docs/errors.md, the page it points to, as GitHub anchors it.
func TestProblemTypesResolve(t *testing.T) {
	page, err := os.ReadFile("docs/errors.md")
	require.NoError(t, err)
	anchors := map[string]bool{}
	for line := range strings.Lines(string(page)) {
		if strings.HasPrefix(line, "#") {
			anchors[githubAnchor(strings.TrimLeft(line, "# "))] = true
		}
	}
	for _, err := range []error{errKeyMissing, errKeyRepeated, ErrInvalidKey, errScope, errBodyUnreadable,
		bodyTooLargeError{1}, ErrMismatch, ErrInFlight, ErrFenced, ErrUnavailable, errClientGone} {
		p := problemFor(err)
		assert.True(t, strings.HasPrefix(p.Type, "https://github.com/idempotency-go/idempotency/blob/main/docs/errors.md#"), p.Type)
		assert.True(t, anchors[p.Code], "docs/errors.md has no heading for %q", p.Code)
		assert.NotContains(t, p.Detail, "idempotency:", "a detail is written for the API's client, not a Go log")
	}
}

// githubAnchor is the anchor GitHub gives a Markdown heading: lower case,
// spaces as hyphens, punctuation other than hyphens and underscores dropped.
func githubAnchor(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(strings.TrimSpace(heading)) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// The default, ProblemDetails: the problem as application/problem+json.
func TestMiddlewareProblemDetails(t *testing.T) {
	rr := serve(New(NewMemoryStore(MemoryOptions{}), Options{}).Middleware(MiddlewareOptions{Scope: SingleTenant})(http.NotFoundHandler()),
		httptest.NewRequest(http.MethodPost, "/charges", nil))
	assert.Equal(t, "application/problem+json", rr.Header().Get("Content-Type"))
	assert.Equal(t, bodyMissingKey, rr.Body.String())
}

// A Middleware without a Scope is refused when it is built, not at the
// first request: sharing keys between tenants is a choice to make.
func TestMiddlewareRequiresScope(t *testing.T) {
	g := New(NewMemoryStore(MemoryOptions{}), Options{})
	assert.PanicsWithValue(t, "idempotency: MiddlewareOptions.Scope is nil: name the account a key belongs to, or use SingleTenant",
		func() { g.Middleware(MiddlewareOptions{}) })
}

// countingServer serves h behind the middleware on a real server, with a
// MemoryStore, and counts the handler's runs.
func countingServer(t *testing.T, o MiddlewareOptions, h http.HandlerFunc) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var runs atomic.Int64
	g := New(NewMemoryStore(MemoryOptions{}), Options{})
	srv := httptest.NewServer(g.Middleware(o)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		h(w, r)
	})))
	t.Cleanup(srv.Close)
	return srv, &runs
}

func postKeyed(t *testing.T, url, key, contentType, body string) (int, http.Header, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set(HeaderKey, key)
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, resp.Header, string(b)
}

// A POST whose parameters are in the query string (r.FormValue reads them,
// as it reads a form body) is a different request when its query differs:
// the same key must answer 422, not replay the other request's answer.
func TestQueryStringIsPartOfTheRequest(t *testing.T) {
	srv, runs := countingServer(t, MiddlewareOptions{Scope: SingleTenant}, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "charged "+r.FormValue("amount"))
	})
	status, _, body := postKeyed(t, srv.URL+"/charge?amount=100", "k1", "", "")
	require.Equal(t, http.StatusOK, status)
	require.Equal(t, "charged 100", body)

	status, h, body := postKeyed(t, srv.URL+"/charge?amount=100000", "k1", "", "")
	assert.Equal(t, http.StatusUnprocessableEntity, status, "replayed %q (%s) for a different amount", body, h.Get(HeaderReplayed))
	assert.EqualValues(t, 1, runs.Load())

	// The same query, its fields in another order, is the same request.
	status, _, _ = postKeyed(t, srv.URL+"/pay?b=2&a=1", "k2", "", "")
	require.Equal(t, http.StatusOK, status)
	status, h, _ = postKeyed(t, srv.URL+"/pay?a=1&b=2", "k2", "", "")
	assert.Equal(t, http.StatusOK, status)
	assert.Equal(t, "true", h.Get(HeaderReplayed))
}

// Two JSON bodies whose numbers differ beyond a double's precision mean
// different things to a Go handler (json.Unmarshal into int64, or
// UseNumber): reusing the key with the other must answer 422.
func TestJSONNumbersBeyondADoubleAreDifferentRequests(t *testing.T) {
	srv, runs := countingServer(t, MiddlewareOptions{Scope: SingleTenant}, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		_, _ = w.Write(b)
	})
	const first = `{"to_account":12345678901234567891,"amount":100}`
	const second = `{"to_account":12345678901234567890,"amount":100}`
	status, _, body := postKeyed(t, srv.URL+"/transfer", "k1", "application/json", first)
	require.Equal(t, http.StatusOK, status)
	require.Equal(t, first, body)
	status, h, body := postKeyed(t, srv.URL+"/transfer", "k1", "application/json", second)
	assert.Equal(t, http.StatusUnprocessableEntity, status, "replayed %q (%s) for another account", body, h.Get(HeaderReplayed))
	assert.EqualValues(t, 1, runs.Load())

	// Spellings of one value still match.
	const a, b = `{"amount":1.50,"to":"x"}`, `{ "to":"x", "amount":1.5 }`
	status, _, _ = postKeyed(t, srv.URL+"/transfer", "k2", "application/json", a)
	require.Equal(t, http.StatusOK, status)
	status, h, _ = postKeyed(t, srv.URL+"/transfer", "k2", "application/json", b)
	assert.Equal(t, http.StatusOK, status)
	assert.Equal(t, "true", h.Get(HeaderReplayed))
}
