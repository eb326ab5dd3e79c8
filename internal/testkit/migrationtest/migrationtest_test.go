package migrationtest_test

import (
	"testing"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/migrationtest"
)

// Run on two memory stores needs no server, so the checks themselves are
// exercised by this package's own tests.
func TestRunMemoryToMemory(t *testing.T) {
	migrationtest.Run(t, idempotency.NewMemoryStore(idempotency.MemoryOptions{}),
		idempotency.NewMemoryStore(idempotency.MemoryOptions{}))
}
