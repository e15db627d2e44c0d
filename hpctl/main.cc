// hpctl: the operator command-line tool. Every subcommand is a library in
// this directory that registers itself (see hpctl/command.h).
#include <iostream>

#include "hpctl/command.h"

int main(int argc, char** argv) {
  return paramd::hpctl::HpctlMain(argc, argv, std::cout, std::cerr);
}
