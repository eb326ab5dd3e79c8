package faultsuite

import (
	"os"
	"testing"

	"github.com/rs/zerolog"
)

func TestMain(m *testing.M) {
	// The proxies log nowhere, but Toxiproxy's bandwidth toxic logs through
	// zerolog's global logger, every chunk it passes.
	zerolog.SetGlobalLevel(zerolog.Disabled)
	os.Exit(m.Run())
}
