package clientcompat_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// nodeDir holds the stripe-node script and the package-lock.json that pins
// stripe-node; (cd internal/testkit/clientcompat/node && npm ci) installs it.
const nodeDir = "node"

// nodeMaxRetries is the script's maxNetworkRetries.
const nodeMaxRetries = 2

// nodeOutcome is a line of node/errors.js: what stripe-node gave the
// application for one call.
type nodeOutcome struct {
	Case  string `json:"case"`
	Threw bool   `json:"threw"`
	// When it resolved: the object's id ("" for none), the answer's status
	// and the object.
	ID     string         `json:"id"`
	Object map[string]any `json:"object"`
	// When it threw: the error's class (constructor.name), its type, the
	// body's error.type, its code and the answer's Stripe-Should-Retry.
	Class       string `json:"class"`
	Type        string `json:"type"`
	RawType     string `json:"rawType"`
	Code        string `json:"code"`
	ShouldRetry string `json:"shouldRetry"`
	// Status is the answer's status either way.
	Status int `json:"status"`
}

// nodeUnavailable skips the test for a missing node or stripe-node, or fails
// it when IDEMPOTENCY_REQUIRE_SERVERS=1, as testserver does for a missing
// server. It never returns.
func nodeUnavailable(t *testing.T, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if testserver.Require() {
		t.Fatalf("%s (%s=1, so this is a failure rather than a skip)", msg, testserver.RequireEnv)
	}
	t.Skipf("%s (skipping; set %s=1 to make this a failure)", msg, testserver.RequireEnv)
}

// stripeNode returns the node binary, once it has checked that the
// stripe-node installed in nodeDir is the 23.x that package-lock.json pins.
func stripeNode(t *testing.T) string {
	t.Helper()
	node, err := exec.LookPath("node")
	if err != nil {
		nodeUnavailable(t, "node not found on PATH; install Node.js 20 or later")
	}
	installed, err := os.ReadFile(filepath.Join(nodeDir, "node_modules", "stripe", "package.json"))
	if err != nil {
		nodeUnavailable(t, "stripe-node is not installed (%v); run: (cd internal/testkit/clientcompat/node && npm ci)", err)
	}
	var pkg struct {
		Version string `json:"version"`
	}
	require.NoError(t, json.Unmarshal(installed, &pkg))
	lockFile, err := os.ReadFile(filepath.Join(nodeDir, "package-lock.json"))
	require.NoError(t, err)
	var lock struct {
		Packages map[string]struct {
			Version string `json:"version"`
		} `json:"packages"`
	}
	require.NoError(t, json.Unmarshal(lockFile, &lock))
	locked := lock.Packages["node_modules/stripe"].Version
	require.True(t, strings.HasPrefix(locked, "23."), "package-lock.json pins stripe %q, not 23.x", locked)
	require.Equal(t, locked, pkg.Version, "the installed stripe-node is not the locked one; run: (cd internal/testkit/clientcompat/node && npm ci)")
	return node
}

// runStripeNode runs node/errors.js against a and returns its lines by case.
func runStripeNode(t *testing.T, node string, a *errorAPI) map[string]nodeOutcome {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	port := strconv.Itoa(a.srv.Listener.Addr().(*net.TCPAddr).Port)
	cmd := exec.CommandContext(ctx, node, "errors.js", port, strconv.Itoa(nodeMaxRetries))
	cmd.Dir = nodeDir
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	require.NoError(t, cmd.Run(), "node errors.js: %s\nstdout: %s\nrequests: %+v", stderr.String(), stdout.String(), a.arr.all())
	t.Logf("stripe-node:\n%s", stdout.String())
	got := map[string]nodeOutcome{}
	sc := bufio.NewScanner(&stdout)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var o nodeOutcome
		require.NoError(t, json.Unmarshal(sc.Bytes(), &o), "line %q", sc.Text())
		got[o.Case] = o
	}
	require.NoError(t, sc.Err())
	return got
}

// The official Stripe Node SDK (stripe-node 23.x, with maxNetworkRetries 2)
// against each of the middleware's errors, in both formats.
//
// stripe-node makes an error of an answer only when its JSON body has an
// "error" member (RequestSender._jsonResponseHandler); any other body it
// resolves with, whatever the status. So with the default problem+json the
// 422, 409, 413 and 503 all reach the application as a successful object
// without an id: the test asserts that, the bug StripeErrors is for. With
// StripeErrors each one throws, with the status, code and the body's type
// in err.rawType; the class is stripe-node's choice by status and type
// (generateV1Error): StripeIdempotencyError for the 400 of a reused key,
// StripeInvalidRequestError for the 400 of a body too large, and
// StripeAPIError for the 409 and 503, as it raises them for Stripe's API.
//
// stripe-node retries a 409 and every 5xx unless Stripe-Should-Retry says
// false, and anything with Stripe-Should-Retry: true, so in both formats
// the 409 and the 503 are sent 1 + maxNetworkRetries times and the
// refusals of the request once.
func TestStripeNodeErrors(t *testing.T) {
	node := stripeNode(t)
	requests := func(t *testing.T, a *errorAPI) {
		t.Helper()
		assert.Equal(t, 2, a.arr.count(keyReused), "the first refund and the reuse, unretried")
		assert.Equal(t, 1+1+nodeMaxRetries, a.arr.count(keyHeld), "the original and the duplicate's 409s")
		assert.Equal(t, 1, a.arr.count(keyBig), "the body too large, unretried")
		assert.Equal(t, 1+nodeMaxRetries, a.arr.count(keyDown), "the 503s")
		assert.Equal(t, 1, a.l.ran(keyReused))
		assert.Equal(t, 1, a.l.ran(keyHeld))
		assert.Equal(t, 2, a.l.made(), "no refund but the two originals")
	}
	// The calls that succeed, in either format.
	originals := func(t *testing.T, got map[string]nodeOutcome) {
		t.Helper()
		for _, c := range []string{"key-reused-first", "in-flight-original"} {
			o := got[c]
			assert.False(t, o.Threw, "%s: %+v", c, o)
			assert.Regexp(t, `^re_[12]$`, o.ID, c)
			assert.Equal(t, http.StatusOK, o.Status, c)
		}
	}

	t.Run("StripeErrors", func(t *testing.T) {
		t.Parallel()
		a := newErrorAPI(t, idempotency.StripeErrors)
		got := runStripeNode(t, node, a)
		originals(t, got)
		for _, c := range []struct {
			code, class, rawType string
			status               int
			shouldRetry          string
		}{
			{"key-reused", "StripeIdempotencyError", "idempotency_error", http.StatusBadRequest, "false"},
			{"in-flight", "StripeAPIError", "idempotency_error", http.StatusConflict, "true"},
			{"body-too-large", "StripeInvalidRequestError", "invalid_request_error", http.StatusBadRequest, "false"},
			{"store-unavailable", "StripeAPIError", "api_error", http.StatusServiceUnavailable, "true"},
		} {
			o, ok := got[c.code]
			require.True(t, ok, "no line for %s", c.code)
			assert.True(t, o.Threw, "%s: stripe-node resolved: %+v", c.code, o)
			assert.Equal(t, c.class, o.Class, c.code)
			assert.Equal(t, c.class, o.Type, c.code)
			assert.Equal(t, c.rawType, o.RawType, c.code)
			assert.Equal(t, c.code, o.Code, c.code)
			assert.Equal(t, c.status, o.Status, c.code)
			assert.Equal(t, c.shouldRetry, o.ShouldRetry, c.code)
		}
		requests(t, a)
	})

	t.Run("ProblemDetails", func(t *testing.T) {
		t.Parallel()
		a := newErrorAPI(t, idempotency.ProblemDetails)
		got := runStripeNode(t, node, a)
		originals(t, got)
		for _, c := range problemStatuses {
			o, ok := got[c.code]
			require.True(t, ok, "no line for %s", c.code)
			assert.False(t, o.Threw, "%s: stripe-node threw: %+v", c.code, o)
			assert.Empty(t, o.ID, "%s: the object has an id", c.code)
			assert.NotContains(t, o.Object, "id", c.code)
			assert.Equal(t, c.status, o.Status, c.code)
			// The object is the problem details, handed over as the refund.
			assert.Equal(t, c.code, o.Object["code"], c.code)
			assert.EqualValues(t, c.status, o.Object["status"], c.code)
		}
		requests(t, a)
	})
}
