package powercut

import (
	"context"
	"os"
	"testing"

	"github.com/redis/go-redis/v9"
)

// quiet drops go-redis's log lines: every kill of the server makes it log
// each failed dial of every pooled connection.
type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

func TestMain(m *testing.M) {
	redis.SetLogger(quiet{})
	os.Exit(m.Run())
}
