// Package storeerr holds the errors that every store returns, so that the
// stores in their own packages (postgres) wrap failures as the root
// package's do. The root package exports the sentinels as
// idempotency.ErrFenced and idempotency.ErrUnavailable.
package storeerr

import (
	"errors"
	"fmt"
)

var (
	// ErrFenced is idempotency.ErrFenced.
	ErrFenced = errors.New("idempotency: fenced off: no longer the owner")
	// ErrUnavailable is idempotency.ErrUnavailable.
	ErrUnavailable = errors.New("idempotency: store unavailable")
)

// Unavailable wraps err, the failure of a store's operation op, so that it
// matches ErrUnavailable and still matches what err matched.
func Unavailable(op string, err error) error {
	return fmt.Errorf("%w: %s: %w", ErrUnavailable, op, err)
}

// Fenced reports that op was refused because the caller no longer owns the
// record.
func Fenced(op string) error {
	return fmt.Errorf("%w: %s", ErrFenced, op)
}
