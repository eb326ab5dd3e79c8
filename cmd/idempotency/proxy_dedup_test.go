package main

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestProxyDuplicateAfterFailure: an upstream that de-duplicates on
// Idempotency-Operation-Key makes its charge, then fails its ledger write
// and answers 503; the retry finds the charge and answers 409 duplicate.
// That 409 is a refusal from a later attempt, after one that may have
// acted, so the proxy releases the key rather than forgetting it (the
// library's keepHistory): the third attempt reaches the upstream under the
// same operation key and gets the original charge, made once.
func TestProxyDuplicateAfterFailure(t *testing.T) {
	for _, name := range []string{"redis", "postgres"} {
		t.Run(name, func(t *testing.T) {
			s := stores(t)[name](t)
			u := startUpstream(t)
			p := startProxy(t, s.flags, u)
			var refused struct{ Error, Operation string }

			first := post(t, p.url, "/ledger", "acct_1", "ledger-1", `{"amount":100}`)
			require.Equal(t, http.StatusServiceUnavailable, first.status, "attempt 1: %s", first.body)
			require.NoError(t, json.Unmarshal([]byte(first.body), &refused))
			op := refused.Operation

			second := post(t, p.url, "/ledger", "acct_1", "ledger-1", `{"amount":100}`)
			require.Equal(t, http.StatusConflict, second.status, "attempt 2: %s", second.body)
			require.NoError(t, json.Unmarshal([]byte(second.body), &refused))
			assert.Equal(t, "duplicate", refused.Error)
			assert.Equal(t, op, refused.Operation, "attempt 2's operation key")

			third := decodeCharge(t, post(t, p.url, "/ledger", "acct_1", "ledger-1", `{"amount":100}`))
			assert.Equal(t, op, third.Seen["Idempotency-Operation-Key"], "attempt 3's operation key")
			assert.Equal(t, "3", third.Seen["Idempotency-Attempt"])
			again := post(t, p.url, "/ledger", "acct_1", "ledger-1", `{"amount":100}`)
			assert.Equal(t, "true", again.header.Get("Idempotent-Replayed"))
			assert.Equal(t, third.ID, decodeCharge(t, again).ID)

			stats := u.stats(t)
			assert.Equal(t, []string{op}, stats.Operations["acct_1/ledger-1"], "operation keys the upstream saw")
			assert.Equal(t, 3, stats.Calls[op], "upstream calls")
			assert.Equal(t, stats.Charges[op], third.ID, "the answer is the original charge")
			assert.Equal(t, 1, stats.Performed[op], "charges made")
		})
	}
}
