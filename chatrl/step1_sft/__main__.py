from chatrl.dist import shutdown
from chatrl.resilience import report_failure
from chatrl.step1_sft.main import main

with report_failure():
    main()
    shutdown()
